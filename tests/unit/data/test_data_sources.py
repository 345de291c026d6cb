"""Data from every kind of reference (rlhf.data.sources / rlhf.data.build): local files and directories, hub
datasets read OFFLINE from the HF cache (config and split), in-process datasets (object://); the config's chat
template and overlong settings; tokenised once by rank 0 (two gloo ranks); clear errors naming file / row / key
with nothing half-written; UltraFeedback-style preference rows for DPO and as prompts for reward-model PPO."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlhf.config import compose_config
from rlhf.config.objects import register_object
from rlhf.data.build import build_rl_dataset, needs_ground_truth, overlong_policy
from rlhf.data.preference import load_preference_dataset
from rlhf.data.rl_dataset import RLHFDataset, truncate
from tests.support.tiny_tokenizer import make_tiny_tokenizer

from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n, start=0):
    return [{"prompt": f"What is {i}+1?", "ground_truth": str(i + 1), "data_source": "arith"}
            for i in range(start, start + n)]


UF_ROWS = [{"prompt": "Write a haiku.", "prompt_id": "a",
            "chosen": [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Old pond"}],
            "rejected": [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "No."}],
            "score_chosen": 8.0, "score_rejected": 2.0},
           {"prompt": "Say hi.", "prompt_id": "b",
            "chosen": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
            "rejected": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Bye."}],
            "score_chosen": 9.0, "score_rejected": 1.0}]


def test_hub_dataset_offline_from_the_hf_cache_with_config_and_split(tmp_path, tok):
    """A hub reference goes through datasets.load_dataset; with HF_DATASETS_OFFLINE=1 it is read from a dataset
    saved in the HF cache layout (tests/support/hf_cache.py).  A subprocess: datasets reads the variables at import."""
    from tests.support.hf_cache import save_in_hf_cache

    cache = tmp_path / "hf" / "datasets"
    gsm = [{"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"He has {i}+2={i + 2}.\n#### {i + 2}"}
           for i in range(5)]
    save_in_hf_cache({"train": gsm[:3], "test": gsm[3:]}, "acme/gsm_mini", "main", str(cache))
    save_in_hf_cache({"train_prefs": UF_ROWS, "test_prefs": UF_ROWS[:1]}, "acme/uf_mini", "default", str(cache))
    code = """
import json
from rlhf.data.rl_dataset import RLHFDataset
from rlhf.data.preference import load_preference_dataset
from tests.support.tiny_tokenizer import make_tiny_tokenizer
tok = make_tiny_tokenizer()
out = {}
refs = [("acme/gsm_mini:main@train", "train"), ("acme/gsm_mini:main", "val"), ("acme/gsm_mini@train[:2]", "train")]
for ref, split in refs:
    ds = RLHFDataset(ref, tok, 256, split=split, require_ground_truth=True)
    out[ref] = [(x["data_source"], x["ground_truth"], x["index"], tok.decode(x["input_ids"])) for x in ds]
pairs = load_preference_dataset("acme/uf_mini@train_prefs")
out["pairs"] = [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs]
ppo = RLHFDataset("acme/uf_mini@test_prefs", tok, 256)
out["ppo"] = [(x["data_source"], x["ground_truth"], x["raw_prompt"]) for x in ppo]
try:
    RLHFDataset("acme/gsm_mini:main@nosuch", tok, 256)
except ValueError as e:
    out["error"] = str(e)
print("RESULT" + json.dumps(out))
"""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(cache), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    train = out["acme/gsm_mini:main@train"]
    # raw GSM8K rows (question / answer): the GSM8K prompt, the #### answer, data_source openai/gsm8k
    assert [(d, g, i) for d, g, i, _ in train] == [("openai/gsm8k", "2", 0), ("openai/gsm8k", "3", 1),
                                                   ("openai/gsm8k", "4", 2)]
    assert "Tom has 0 apples" in train[0][3] and "<|im_start|>assistant" in train[0][3]  # GSM8K template + chat
    assert [g for _, g, _, _ in out["acme/gsm_mini:main"]] == ["5", "6"]  # validation: the test split
    assert len(out["acme/gsm_mini@train[:2]"]) == 2
    assert out["pairs"] == [["Write a haiku.", "Old pond", "No."], ["Say hi.", "Hi!", "Bye."]]
    assert out["ppo"] == [["acme/uf_mini", None, "Write a haiku."]]  # prompts for a reward model: no ground truth
    assert "split 'nosuch'" in out["error"] and "acme/gsm_mini:main@SPLIT" in out["error"]


def test_local_files_dirs_and_objects_concatenate_in_order(tmp_path, tok):
    d = tmp_path / "dir"
    d.mkdir()
    _jsonl(d / "a.jsonl", _rows(2))
    _jsonl(d / "b.jsonl", _rows(1, start=2))
    uri = register_object([{"prompt": [{"role": "user", "content": "Hi"}], "ground_truth": "x", "data_source": "o"}],
                          "dataset")
    ds = RLHFDataset([str(d), uri], tok, 64, require_ground_truth=True)
    assert [x["ground_truth"] for x in ds] == ["1", "2", "3", "x"] and [x["index"] for x in ds] == [0, 1, 2, 3]
    assert ds.files == [str(d / "a.jsonl"), str(d / "b.jsonl"), uri]
    import datasets

    uri2 = register_object(datasets.Dataset.from_list(_rows(2)), "dataset")
    assert [x["ground_truth"] for x in RLHFDataset(uri2, tok, 64)] == ["1", "2"]


def test_config_chat_template_and_overlong_policies(tmp_path, tok):
    f = _jsonl(tmp_path / "t.jsonl", [{"prompt": "x " * 40, "ground_truth": "1", "data_source": "a"},
                                      {"prompt": "short", "ground_truth": "2", "data_source": "a"}])
    cfg = compose_config(["data.max_prompt_length=24"]).data
    assert overlong_policy(cfg) == "filter"
    ds = build_rl_dataset(cfg, "train", f, tok, None)
    assert [x["ground_truth"] for x in ds] == ["2"] and ds.num_filtered == 1
    plain = compose_config(["data.max_prompt_length=24", "data.apply_chat_template=false"]).data
    (item,) = build_rl_dataset(plain, "train", f, tok, None)
    assert tok.decode(item["input_ids"]) == "short"  # no template: the plain text
    long_ids = tok("x " * 40)["input_ids"]
    for side in ("left", "right", "middle"):
        c = compose_config(["data.max_prompt_length=24", "data.apply_chat_template=false",
                            "data.filter_overlong_prompts=false", f"data.truncation={side}"]).data
        first = build_rl_dataset(c, "train", f, tok, None)[0]["input_ids"]
        assert first == truncate(long_ids, 24, side) and len(first) == 24
    assert truncate([1, 2, 3, 4, 5], 3, "middle") == [1, 2, 5] and truncate([1, 2, 3], 2, "left") == [2, 3]
    err = compose_config(["data.max_prompt_length=24", "data.filter_overlong_prompts=false",
                          "data.truncation=error"]).data
    with pytest.raises(ValueError, match=r"t\.jsonl: row 0: the prompt has \d+ tokens > max_prompt_length=24"):
        build_rl_dataset(err, "train", f, tok, None)
    kw = compose_config(["data.chat_template_kwargs={enable_thinking: false}"]).data
    seen = []
    real = tok.apply_chat_template
    tok2 = make_tiny_tokenizer()
    tok2.apply_chat_template = lambda m, **k: seen.append(k) or real(m, **{a: b for a, b in k.items()
                                                                              if a != "enable_thinking"})
    build_rl_dataset(kw, "train", f, tok2, None)
    assert seen and seen[0]["enable_thinking"] is False


def test_errors_name_file_row_and_key(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: the dataset has no rows"):
        RLHFDataset(str(empty), tok, 64)
    no_gt = _jsonl(tmp_path / "nogt.jsonl", _rows(1) + [{"prompt": "p", "data_source": "arith"}])
    with pytest.raises(KeyError, match=r"nogt\.jsonl: row 1: no ground truth.*'ground_truth'"):
        RLHFDataset(no_gt, tok, 64, require_ground_truth=True)
    assert len(RLHFDataset(no_gt, tok, 64)) == 2  # a reward model needs none
    bad_type = _jsonl(tmp_path / "badtype.jsonl", [{"prompt": 42, "ground_truth": "1", "data_source": "a"}])
    with pytest.raises(TypeError, match=r"badtype\.jsonl: row 0: prompt must be a string .* got int"):
        RLHFDataset(bad_type, tok, 64)
    no_prompt = _jsonl(tmp_path / "noprompt.jsonl", [{"question_text": "q", "ground_truth": "1"}])
    with pytest.raises(KeyError, match=r"noprompt\.jsonl: row 0: row has no 'prompt' field"):
        RLHFDataset(no_prompt, tok, 64)
    longf = _jsonl(tmp_path / "long.jsonl", [{"prompt": "y " * 30, "ground_truth": "1", "data_source": "a"}] * 2)
    with pytest.raises(ValueError, match=r"No prompts left: the shortest prompt has \d+ tokens; raise "
                                         r"data.max_prompt_length"):
        RLHFDataset(longf, tok, 8)


def test_needs_ground_truth_follows_the_reward():
    assert needs_ground_truth(compose_config([]).reward)
    assert not needs_ground_truth(compose_config(["reward.sources=[{type: model, path: /m}]"]).reward)
    assert needs_ground_truth(compose_config(["reward.sources=[{type: model, path: /m}, {type: rule}]"]).reward)


def test_ultrafeedback_pairs_from_a_local_file(tmp_path):
    f = _jsonl(tmp_path / "uf.jsonl", UF_ROWS + [dict(UF_ROWS[0], prompt=None)])
    pairs = load_preference_dataset(f)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [
        ("Write a haiku.", "Old pond", "No."), ("Say hi.", "Hi!", "Bye."),
        ([{"role": "user", "content": "Write a haiku."}], "Old pond", "No.")]  # no prompt: the conversation's
    bad = _jsonl(tmp_path / "bad.jsonl", [dict(UF_ROWS[0], chosen=[{"role": "user", "content": "x"}])])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 0: 'chosen' as chat messages must end with an assistant"):
        load_preference_dataset(bad)


DIST = r"""
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
from rlhf.config import compose_config
from rlhf.data import build as B
from rlhf.data import rl_dataset
from tests.support.tiny_tokenizer import make_tiny_tokenizer
calls = []
real = rl_dataset.RLHFDataset._consume
rl_dataset.RLHFDataset._consume = lambda self, *a: calls.append(1) or real(self, *a)
cfg = compose_config(["data.max_prompt_length=32"]).data
out = {"rank": dist.get_rank()}
ds = B.build_rl_dataset(cfg, "train", sys.argv[1], make_tiny_tokenizer(), sys.argv[2])
out["items"] = [x["input_ids"] for x in ds]
out["tokenised"] = len(calls)
out["has_tokenizer"] = ds.tokenizer is not None
try:
    B.build_rl_dataset(cfg, "val", sys.argv[3], make_tiny_tokenizer(), sys.argv[2], require_ground_truth=True)
except KeyError as e:
    out["error"] = (type(e).__name__, e.args[0])
with open(os.path.join(sys.argv[4], f"result_{dist.get_rank()}.json"), "w") as f:  # not stdout: the ranks share it
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_rank0_tokenises_once_and_errors_reach_every_rank(tmp_path):
    from tests.support.dist_utils import free_port

    f = _jsonl(tmp_path / "train.jsonl", _rows(5))
    bad = _jsonl(tmp_path / "bad.jsonl", _rows(1) + [{"prompt": "p", "data_source": "a"}])
    script = tmp_path / "dist_data.py"
    script.write_text(DIST)
    cache = tmp_path / "cache"
    # each rank writes its result to its own file: lines the two ranks print to the stdout they share can
    # interleave (CI once read one line holding both ranks' results)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(script), f, str(cache), bad, str(tmp_path)],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    assert [o["rank"] for o in outs] == [0, 1]
    assert [o["tokenised"] for o in outs] == [1, 0]  # rank 1 read rank 0's result
    assert outs[0]["items"] == outs[1]["items"] and len(outs[0]["items"]) == 5
    assert all(o["has_tokenizer"] for o in outs)
    for o in outs:  # the same clear error on both ranks, nothing written for the failed split
        assert o["error"][0] == "KeyError" and "bad.jsonl: row 1: no ground truth" in o["error"][1]
    assert sorted(os.listdir(cache)) == ["train_prompts.pkl"]


def test_prompts_without_a_data_source_are_named_by_their_file_for_a_reward_model(tmp_path, tok):
    from rlhf.data.sources import source_label

    f = _jsonl(tmp_path / "chat_prompts.jsonl", [{"prompt": "Say hi."}])
    cfg = compose_config([]).data
    (item,) = build_rl_dataset(cfg, "train", f, tok, None, require_ground_truth=False)
    assert item["data_source"] == "chat_prompts" and item["ground_truth"] is None
    with pytest.raises(KeyError, match=r"chat_prompts\.jsonl: row 0: row has no 'data_source'"):
        build_rl_dataset(cfg, "train", f, tok, None, require_ground_truth=True)
    assert source_label("openai/gsm8k") == "openai/gsm8k" and source_label("object://dataset/3") == "dataset"


def test_validation_runs_on_the_whole_val_set_unless_limited(tmp_path, tok):
    """data.max_val_samples defaults to null (verl): all 100 validation prompts, not the first 64; a limit still
    applies when given (the CPU recipes set theirs in recipes/_base/tiny_cpu.yaml)."""
    f = _jsonl(tmp_path / "val.jsonl", [{"prompt": f"q{i}", "ground_truth": str(i), "data_source": "a"}
                                        for i in range(100)])
    cfg = compose_config([]).data
    assert cfg.max_val_samples is None
    assert len(build_rl_dataset(cfg, "val", f, tok, None)) == 100
    assert len(build_rl_dataset(compose_config(["data.max_val_samples=10"]).data, "val", f, tok, None)) == 10
    assert compose_config([], recipe="quickstart").data.max_val_samples == 64  # the recipe's own cap
