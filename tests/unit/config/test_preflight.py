"""Start-up checks of a run's surroundings (rlhf/preflight.py, rlhf/data/length_check.py): a hub dataset
while offline, wandb without credentials, data.max_prompt_length against the data; each reported by
config_problems(check_files=True) (``--cfg``, ``rlhf launch``, ``rlhf.Trainer(...)``) before any model."""
from __future__ import annotations

import pytest

from rlhf.config import ConfigValidationError, compose_config
from rlhf.preflight import hub_data_problems
from rlhf.config.validate import config_problems


@pytest.fixture()
def offline_home(tmp_path, monkeypatch):
    """An empty HF cache, no W&B credentials, the hub marked offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return tmp_path


def test_hub_dataset_offline_is_a_config_problem(offline_home):
    cfg = compose_config(["data.train_files=openai/gsm8k:main@train", f"trainer.default_local_dir={offline_home}"])
    problems = config_problems(cfg, world_size=1, check_files=True)
    assert problems == ["data.train_files='openai/gsm8k:main@train' is a hub dataset that is not in the local HF "
                        "cache, and the hub cannot be reached (HF_HUB_OFFLINE=1): download it where there is a "
                        "network (datasets.load_dataset('openai/gsm8k'), then copy ~/.cache/huggingface), or give "
                        "a local .jsonl/.parquet file."]
    # an unreachable endpoint (no offline variable) reads the same; the probe runs once, for the first such ref
    calls = []
    cfg = compose_config(["data.train_files=[openai/gsm8k,openai/gsm8k]", "data.val_files=openai/gsm8k"])
    out = hub_data_problems(cfg, unreachable=lambda: calls.append(1) or "huggingface.co:443 is unreachable (x)")
    assert len(out) == 3 and calls == [1] and out[1].startswith("data.train_files[1]='openai/gsm8k'")
    assert hub_data_problems(cfg, unreachable=lambda: None) == []  # online: the trainer downloads it
    (offline_home / "hf" / "datasets" / "openai___gsm8k" / "main").mkdir(parents=True)  # in datasets' cache
    assert hub_data_problems(cfg, unreachable=lambda: "offline") == []


def test_wandb_without_credentials_is_a_config_problem(offline_home, monkeypatch):
    cfg = compose_config(["trainer.logger=[console,wandb]"])
    problems = config_problems(cfg, world_size=1, check_files=True)
    assert len(problems) == 1 and "no W&B credentials" in problems[0] and "WANDB_MODE=offline" in problems[0] \
        and "wandb login" in problems[0]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert config_problems(cfg, world_size=1, check_files=True) == []
    monkeypatch.delenv("WANDB_MODE")
    (offline_home / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert config_problems(cfg, world_size=1, check_files=True) == []


@pytest.fixture(scope="module")
def tok():
    from rlhf.quickstart.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


def test_prompt_length_against_the_data_from_the_python_api(tok, offline_home):
    """Trainer(...) with a dataset whose prompts are all longer than data.max_prompt_length=64 fails at once,
    naming the smallest limit that keeps them all; that limit is the dataset filter's (RLHFDataset keeps
    every prompt at it and drops the longest one below it)."""
    from rlhf import Trainer
    from rlhf.config.objects import register_object
    from rlhf.data.rl_dataset import RLHFDataset
    from rlhf.quickstart.tokenizer import prompt_ids

    rows = [{"prompt": [{"role": "user", "content": "count " * k}], "ground_truth": "1", "data_source": "gsm8k"}
            for k in (70, 90, 120, 75)]
    lengths = [len(prompt_ids(tok, r["prompt"])) for r in rows]
    assert min(lengths) > 64
    with pytest.raises(ConfigValidationError) as e:
        Trainer(dataset=rows, tokenizer=tok, output_dir=str(offline_home / "run"))
    msg = str(e.value)
    assert f"data.max_prompt_length=64 keeps 0 of the 4 prompts of data.train_files=" in msg
    assert f"they have {min(lengths)}..{max(lengths)} tokens" in msg
    assert f"set data.max_prompt_length={max(lengths)} to keep them all" in msg
    assert "keeps 0 of the 4 prompts of data.val_files=" in msg
    uri = register_object(rows, "dataset")
    assert len(RLHFDataset(uri, tok, max(lengths))) == 4 and len(RLHFDataset(uri, tok, max(lengths) - 1)) == 3
    # at that limit (one batch of 4 prompts) the check passes
    Trainer(dataset=rows, tokenizer=tok, output_dir=str(offline_home / "run"),
            **{"data.max_prompt_length": max(lengths), "data.train_batch_size": 4,
               "actor.ppo_mini_batch_size": 4, "critic.ppo_mini_batch_size": 4})
    # fewer prompts fit than one training batch: refused too, with the fraction kept
    with pytest.raises(ConfigValidationError, match=r"keeps 2 of the 4 prompts .* \(50%\); a training batch needs "
                                                     r"data.train_batch_size=4"):
        Trainer(dataset=rows, tokenizer=tok, output_dir=str(offline_home / "run"),
                **{"data.max_prompt_length": sorted(lengths)[1], "data.train_batch_size": 4,
                   "actor.ppo_mini_batch_size": 4, "critic.ppo_mini_batch_size": 4})


def test_a_row_without_a_usable_prompt_is_refused_before_any_build(tok, offline_home):
    """A row the dataset builder would stop on (here row 1's prompt is an int) is a config problem naming the row,
    raised by Trainer(...) before Ray, an engine or a model starts."""
    from rlhf import Trainer

    rows = [{"prompt": "1+1=", "ground_truth": "2", "data_source": "gsm8k"},
            {"prompt": 12345, "ground_truth": "3", "data_source": "gsm8k"}]
    with pytest.raises(ConfigValidationError,
                       match=r"data\.train_files='[^']*': .*row 1: prompt must be a string or a list of chat messages, "
                             r"got int"):
        Trainer(dataset=rows, tokenizer=tok, output_dir=str(offline_home / "run"))


def test_dpo_pairs_of_chat_messages_without_a_prompt_column_pass_and_a_bad_pair_is_named(tmp_path, offline_home):
    """DPO data is read as preference pairs (rlhf.data.preference.load_preference_dataset): chosen / rejected as chat
    messages carry the prompt in their leading turns, so a row without a prompt column is valid and passes the
    preflight; a pair the DPO trainer would stop on (identical chosen and rejected) is a config problem naming it."""
    import json

    def pair(q, good, bad):
        ask = [{"role": "user", "content": q}]
        return {"chosen": ask + [{"role": "assistant", "content": good}],
                "rejected": ask + [{"role": "assistant", "content": bad}]}

    good = tmp_path / "pairs.jsonl"
    good.write_text("".join(json.dumps(pair(f"{i}+1=", str(i + 1), str(i))) + "\n" for i in range(4)))
    args = ["algorithm.name=dpo", "model.path=tiny://quickstart", f"data.train_files={good}",
            f"data.val_files={good}", f"trainer.default_local_dir={offline_home}"]
    assert config_problems(compose_config(args), world_size=1, check_files=True) == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + json.dumps(pair("2+2=", "4", "4")) + "\n")
    problems = config_problems(compose_config(args[:2] + [f"data.train_files={bad}", f"data.val_files={good}"]),
                               world_size=1, check_files=True)
    assert len(problems) == 1 and problems[0].startswith(f"data.train_files={str(bad)!r}: ") \
        and "row 4: chosen and rejected are identical; a pair must differ." in problems[0], problems


def test_a_bad_row_past_what_the_builder_reads_is_not_refused(tmp_path, offline_home):
    """data.max_train_samples caps what the builders read: a bad row after the first max_train_samples pairs (DPO:
    load_preference_dataset stops there) or after max_train_samples kept prompts (RL: RLHFDataset stops there)
    is never read by the trainer, so the preflight passes; without the cap the same file is refused."""
    import json

    ask = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    pairs = [{"chosen": ask(f"{i}+1=") + [{"role": "assistant", "content": str(i + 1)}],
              "rejected": ask(f"{i}+1=") + [{"role": "assistant", "content": str(i)}]} for i in range(4)]
    pairs[3]["rejected"] = pairs[3]["chosen"]  # row 3: identical, the DPO trainer's ValueError
    dpo = tmp_path / "pairs.jsonl"
    dpo.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prompts = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": "gsm8k"} for i in range(4)]
    prompts[3]["prompt"] = 12345  # row 3: not a prompt, normalize_row's TypeError
    rl = tmp_path / "prompts.jsonl"
    rl.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    base = ["model.path=tiny://quickstart", f"trainer.default_local_dir={offline_home}", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2"]
    for algo, data in (("algorithm.name=dpo", dpo), ("algorithm.name=ppo", rl)):
        args = base + [algo, f"data.train_files={data}", f"data.val_files={data}", "data.max_val_samples=3"]
        problems = config_problems(compose_config(args), world_size=1, check_files=True)
        assert len(problems) == 1 and problems[0].startswith(f"data.train_files={str(data)!r}: ") \
            and "row 3: " in problems[0], (algo, problems)
        capped = config_problems(compose_config(args + ["data.max_train_samples=3"]), world_size=1, check_files=True)
        assert capped == [], (algo, capped)
