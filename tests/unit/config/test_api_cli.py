"""Python API (`rlhf.Trainer`), the `rlhf launch` command, and the per-algorithm recipes: config
building, validation and launch commands (no training here; see tests/e2e/test_algorithms_e2e.py).
CPU only, fast."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlhf import Trainer
from rlhf.api import ALGORITHMS, build_overrides, format_value
from rlhf.cli import main as cli_main
from rlhf.config import ConfigError, compose_config, validate_config
from rlhf.main import main as main_cli

from tests.support.paths import REPO
# recipe -> trainer processes it is written for
RECIPES = {"grpo_tiny_cpu": 1, "rloo_tiny_cpu": 1, "reinforce_pp_tiny_cpu": 1, "dapo_tiny_cpu": 1,
           "dpo_tiny_cpu": 1, "grpo_qwen2_7b": 8, "dapo_qwen2_7b": 8, "dpo_qwen2_7b": 8}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)


# --------------------------------------------------------------------------- Python API


def _model_dir(path: Path) -> Path:
    """A model directory with a real (small) Qwen2 config.json (the start-up checks read it)."""
    from transformers import Qwen2Config

    Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, architectures=["Qwen2ForCausalLM"]).save_pretrained(path)
    return path


def test_trainer_builds_the_recipe_config_with_overrides(tmp_path):
    actor = _model_dir(tmp_path / "models" / "actor")
    t = Trainer(algorithm="grpo", recipe="quickstart", actor_model=actor, dataset="embedded://arithmetic",
                output_dir=tmp_path / "out", total_training_steps=3, actor__optim__lr=2e-4,
                **{"rollout.val_kwargs.temperature": 1.0})
    c = t.config
    assert c.algorithm.adv_estimator == "grpo" and c.critic.enable is None  # quickstart's critic switched off
    assert c.model.path == str(actor) and c.trainer.default_local_dir == str(tmp_path / "out")
    assert c.data.train_files == c.data.val_files == "embedded://arithmetic"
    assert c.trainer.total_training_steps == 3 and c.actor.optim.lr == 2e-4
    assert c.rollout.val_kwargs.temperature == 1.0
    assert c.rollout.n == compose_config([], recipe="quickstart").rollout.n >= 2  # the recipe's n is kept
    # the same config as the command line
    assert compose_config(t.overrides, recipe="quickstart") == c
    cmd = t.command(nproc=2)
    assert cmd[:6] == ["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=2", "-m", "rlhf.main"]
    assert cmd[6] == "recipe=quickstart" and f"model.path={actor}" in cmd


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_preset_validates(algorithm):
    c = Trainer(algorithm=algorithm).config  # base config, no recipe
    est = {"dpo": "gae", "ppo": "gae", "dr_grpo": "grpo", "dapo": "grpo"}.get(algorithm, algorithm)
    assert c.algorithm.name == ("dpo" if algorithm == "dpo" else "ppo") and c.algorithm.adv_estimator == est
    if algorithm in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "dapo"):
        assert c.rollout.n == 4  # a group estimator needs several responses; the base config has 1
    if algorithm == "dapo":
        assert c.algorithm.filter_groups.enable and c.reward.overlong_buffer.enable
        assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high, c.actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    if algorithm == "dr_grpo":
        assert not c.algorithm.norm_adv_by_std_in_grpo and c.actor.loss_agg_mode == "seq-mean-token-sum-norm"


@pytest.mark.parametrize("recipe", [None, "quickstart"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_preset_gives_the_same_config_through_cli_api_and_launch(algorithm, recipe, capsys):
    """`python -m rlhf.main algorithm=X`, `Trainer(algorithm=X)` and `rlhf launch --algorithm X` (the command it
    runs) compose the same resolved config, which validates: one source, rlhf/config/algorithm/X.yaml."""
    args = ([f"recipe={recipe}"] if recipe else []) + [f"algorithm={algorithm}"]
    assert cli_main(["launch", "--algorithm", algorithm, "--nproc", "1", "--dry_run"]
                    + (["--recipe", recipe] if recipe else [])) == 0
    launched = shlex.split(capsys.readouterr().out.strip())
    assert launched[launched.index("rlhf.main") + 1:] == args  # launch runs exactly this command line
    assert main_cli(args + ["--cfg"]) == 0
    cli = capsys.readouterr().out
    trainer = Trainer(algorithm=algorithm, recipe=recipe)
    assert OmegaConf.to_yaml(trainer.config) == cli and trainer.command()[6:] == args
    c = yaml.safe_load(cli)
    assert c["rollout"]["n"] >= 2 or algorithm in ("ppo", "reinforce_plus_plus", "dpo")


def test_named_arguments_and_reward_forms(tmp_path):
    ov = build_overrides("ppo", actor_model="Qwen/Qwen2-7B", critic_model="/m/critic", reward_model="/m/rm",
                         dataset=["a.jsonl", "b.jsonl"], val_dataset="v.jsonl")
    assert "model.critic_path=/m/critic" in ov and "critic.enable=true" in ov and "model.path=Qwen/Qwen2-7B" in ov
    assert "reward.sources=[{type:model,path:/m/rm,weight:1.0}]" in ov
    assert "data.train_files=[a.jsonl,b.jsonl]" in ov and "data.val_files=v.jsonl" in ov
    f = tmp_path / "my_reward.py"
    f.write_text("def score(solution_str, ground_truth):\n    return 1.0\n")
    c = Trainer(reward_model=f"{f}:score").config
    assert c.reward.custom_reward_function.path == str(f) and c.reward.custom_reward_function.name == "score"
    c = Trainer(reward_model=[{"type": "rule", "weight": 1.0}, {"type": "custom", "path": str(f), "weight": 0.5}]).config
    assert [s.type for s in c.reward.sources] == ["rule", "custom"] and c.reward.sources[1].weight == 0.5


def test_bad_arguments_fail_early():
    with pytest.raises(TypeError, match="ambiguous.*actor.optim.lr"):
        Trainer(lr=1e-5)
    with pytest.raises(TypeError, match="trainer.total_training_steps"):
        Trainer(total_trainig_steps=3)
    with pytest.raises(ValueError, match="unknown algorithm"):
        Trainer(algorithm="ppo2")
    with pytest.raises(ValueError, match="critic_model"):
        Trainer(algorithm="grpo", critic_model="/m")
    with pytest.raises(ConfigError, match="actor.optim.lrr"):
        Trainer(**{"actor.optim.lrr": 1.0})
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        Trainer(actor__ppo_mini_batch_size=3)


def test_format_value_round_trips_through_hydra():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for v in ["tiny://quickstart", "/tmp/a b/c", "it's", "1e-4", "true", "null", "x=y", 3, 0.5, None, True,
              ["a", "b c"], {"type": "model", "path": "/m", "weight": 0.5}]:
        parsed = OverridesParser.create().parse_overrides([f"k={format_value(v)}"])[0].value()
        assert parsed == v, (v, format_value(v), parsed)
    assert format_value("Qwen/Qwen2-7B") == "Qwen/Qwen2-7B"  # plain tokens stay unquoted


def test_api_example_runs_under_torchrun_style_env(monkeypatch):
    """Each torchrun rank builds the same config; world size checks use the launcher's."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="data-parallel size 3"):
        Trainer(algorithm="grpo", recipe="grpo_tiny_cpu")


# --------------------------------------------------------------------------- rlhf launch


def test_launch_dry_run_prints_torchrun(capsys, tmp_path):
    rc = cli_main(["launch", "--algorithm", "grpo", "--model_name_or_path", "Qwen/Qwen2.5-7B-Instruct",
                   "--dataset_name", "embedded://arithmetic", "--output_dir", str(tmp_path / "o"), "--nproc", "2",
                   "--dry_run", "trainer.total_training_steps=3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "-m torch.distributed.run --standalone --nnodes=1 --nproc_per_node=2 -m rlhf.main" in out
    assert "algorithm=grpo" in out and "model.path=Qwen/Qwen2.5-7B-Instruct" in out
    assert f"trainer.default_local_dir={tmp_path / 'o'}" in out and "trainer.total_training_steps=3" in out


def test_launch_slurm_prints_sbatch_of_the_algorithm_recipe(capsys, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    rc = cli_main(["launch", "--algorithm", "dapo", "--model_name_or_path", "Qwen/Qwen2-7B-Instruct", "--dataset_name",
                   str(data), "--output_dir", "out/dapo", "--slurm", "trainer.save_freq=5"])
    out = capsys.readouterr().out.strip()
    assert rc == 0 and out.startswith(f"cd {REPO} && sbatch recipes/dapo_qwen2_7b/run_slurm.sbatch ")
    assert f"data.train_files={data}" in out and f"trainer.default_local_dir={os.path.abspath('out/dapo')}" in out
    assert "algorithm=dapo" in out and "trainer.save_freq=5" in out
    assert "recipe=" not in out.split("run_slurm.sbatch")[1]  # the sbatch script names its recipe
    assert (REPO / "recipes/dapo_qwen2_7b/run_slurm.sbatch").is_file()
    # the full validation runs before anything is printed: the recipe's default data is not here
    assert cli_main(["launch", "--algorithm", "dpo", "--slurm"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "data.train_files='../shared/data/preference/train.jsonl'" in captured.err
    # preference pairs are read at launch, whatever the tokenizer: an empty file is refused, one pair passes
    assert cli_main(["launch", "--algorithm", "dpo", "--slurm", "--dataset_name", str(data)]) == 2
    assert f"data.train_files={str(data)!r}: " in capsys.readouterr().err
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    rc = cli_main(["launch", "--algorithm", "dpo", "--slurm", "--dataset_name", str(pairs)])
    assert rc == 0 and "recipes/dpo_qwen2_7b/run_slurm.sbatch algorithm=dpo" in capsys.readouterr().out


def test_launch_errors_exit_2(capsys):
    assert cli_main(["launch", "--algorithm", "grpo", "trainer.total_trainig_steps=3", "--dry_run"]) == 2
    assert "Did you mean: trainer.total_training_steps" in capsys.readouterr().err
    assert cli_main(["launch", "notakeyvalue", "--dry_run"]) == 2


def test_launch_runs_torchrun(tmp_path):
    """Without --dry_run the command really runs (here: a stub python that records its argv)."""
    log = tmp_path / "argv"
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/bash\necho \"$@\" > {log}\n")
    stub.chmod(0o755)
    code = textwrap.dedent(f"""
        import sys; sys.executable = {str(stub)!r}
        from rlhf.cli import main; sys.exit(main(["launch", "--recipe", "dpo_tiny_cpu", "--nproc", "1"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert log.read_text().split() == ["-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                                       "--nproc_per_node=1", "-m", "rlhf.main", "recipe=dpo_tiny_cpu"]


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_composes_validates_and_has_scripts(name):
    cfg = compose_config([], recipe=name)
    validate_config(cfg, world_size=RECIPES[name])
    assert cfg.trainer.default_local_dir == f"outputs/{name}"
    for fn in ("run_torchrun.sh", "run_slurm.sbatch"):
        script = REPO / "recipes" / name / fn
        assert script.is_file() and os.access(script, os.X_OK)
        text = script.read_text()
        assert f"recipe={name}" in text or f"RECIPE={name}" in text
    algo = {"grpo": ("ppo", "grpo"), "rloo": ("ppo", "rloo"), "reinforce": ("ppo", "reinforce_plus_plus"),
            "dapo": ("ppo", "grpo"), "dpo": ("dpo", "gae")}[name.split("_")[0]]
    assert (cfg.algorithm.name, cfg.algorithm.adv_estimator) == algo
    if algo[0] == "ppo":
        assert cfg.critic.enable is None and cfg.rollout.n >= 2  # no critic for critic-free estimators
    if name.startswith("dapo"):
        assert cfg.algorithm.filter_groups.enable and cfg.reward.overlong_buffer.enable
        assert cfg.actor.clip_ratio_high > cfg.actor.clip_ratio_low and cfg.actor.loss_agg_mode == "token-mean"
    if name.endswith("qwen2_7b"):
        assert cfg.model.dtype == "bfloat16" and cfg.parallel.tensor_model_parallel_size == 4
    else:
        assert cfg.model.path == "tiny://quickstart"


# --------------------------------------------------------------------------- the tutorial's flags, in-process objects


def _launched_config(capsys) -> tuple[list[str], object]:
    """The overrides of the printed torchrun command and the config they compose to."""
    argv = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    overrides = argv[argv.index("rlhf.main") + 1:]
    return argv, compose_config(overrides)


def test_tutorial_launch_flags_map_onto_the_config(tmp_path, capsys):
    """`rlhf launch` with the tutorial's trl-style flags: per-device micro batch, accumulation -> mini batch
    (micro x accumulation x data-parallel size sequences, in prompts of rollout.n responses), rollout samples per
    step -> data.train_batch_size x rollout.n, logging / save frequency."""
    rm = _model_dir(tmp_path / "rm")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "data_source": "arithmetic", "reward_model": {"ground_truth": "2"}}\n')
    flags = ["launch", "--algorithm", "ppo", "--model_name_or_path", "tiny://quickstart", "--reward_model_name_or_path",
             str(rm), "--dataset_name", str(data), "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "8", "--num_rollout_samples", "128", "--output_dir", str(tmp_path / "out"), "--logging_steps", "10",
             "--save_steps", "100"]
    assert cli_main([*flags, "--nproc", "1", "--dry_run"]) == 0
    argv, c = _launched_config(capsys)
    assert "--nproc_per_node=1" in argv
    assert (c.actor.ppo_micro_batch_size_per_gpu, c.critic.ppo_micro_batch_size_per_gpu) == (4, 4)
    assert (c.rollout.n, c.data.train_batch_size, c.actor.ppo_mini_batch_size, c.critic.ppo_mini_batch_size) == \
        (1, 128, 4 * 8 * 1, 32)
    assert (c.trainer.log_freq, c.trainer.save_freq, c.trainer.default_local_dir) == (10, 100, str(tmp_path / "out"))
    assert [(s.type, s.path) for s in c.reward.sources] == [("model", str(rm))]
    # GRPO (4 responses per prompt) on 2 processes: 128 samples = 32 prompts; 4 x 8 x 2 = 64 sequences = 16 prompts
    assert cli_main([*flags[:2], "grpo", *flags[3:], "--nproc", "2", "--dry_run"]) == 0
    argv, c = _launched_config(capsys)
    assert "--nproc_per_node=2" in argv
    assert (c.rollout.n, c.data.train_batch_size, c.actor.ppo_mini_batch_size) == (4, 32, 16)
    validate_config(c, world_size=2, check_files=True)
    # samples that are not whole prompts, and a missing data file: refused before anything is printed or run
    assert cli_main([*flags[:2], "grpo", *flags[3:], "--num_rollout_samples", "130", "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert "--num_rollout_samples 130 is not a multiple of rollout.n=4" in err
    bad = [*flags[:8], str(tmp_path / "missing.jsonl"), *flags[9:]]
    for extra in (["--dry_run"], ["--slurm"]):
        assert cli_main([*bad, "--nproc", "1", *extra]) == 2
        out = capsys.readouterr()
        assert out.out == "" and "missing.jsonl': no such file or directory" in out.err


def test_safety_reward_model_and_reward_forms(tmp_path):
    """safety_reward_model= is one more weighted source; a callable reward stays in this process."""
    rm, safety = _model_dir(tmp_path / "rm"), _model_dir(tmp_path / "safety")
    c = Trainer(reward_model=rm, safety_reward_model=safety, safety_reward_weight=0.5).config
    assert [(s.type, s.path, s.weight) for s in c.reward.sources] == [("model", str(rm), 1.0),
                                                                      ("model", str(safety), 0.5)]
    c = Trainer(safety_reward_model=safety).config  # the rule reward of each data_source, plus the safety model
    assert [(s.type, s.weight) for s in c.reward.sources] == [("rule", 1.0), ("model", 1.0)]

    def my_reward(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    from rlhf.config.objects import get_object

    c = Trainer(reward_model=my_reward, safety_reward_model=safety, safety_reward_weight=0.25).config
    (main_src, safety_src) = c.reward.sources
    assert main_src.type == "custom" and get_object(main_src.path) is my_reward and safety_src.weight == 0.25
    assert Trainer(reward_model=my_reward).config.reward.sources[0].path == main_src.path  # registered once


def test_in_process_dataset_and_tokenizer_objects():
    import datasets

    from rlhf.config.objects import get_object

    rows = [{"prompt": "1+1=", "data_source": "arithmetic", "reward_model": {"ground_truth": "2"}}] * 4
    ds = datasets.Dataset.from_list(rows)
    t = Trainer(dataset=ds, recipe="quickstart")
    assert get_object(t.config.data.train_files) is ds and t.config.data.val_files == t.config.data.train_files
    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(rows[:2])})
    c = Trainer(dataset=dd, recipe="quickstart").config
    assert get_object(c.data.train_files) is dd["train"] and get_object(c.data.val_files) is dd["test"]
    c = Trainer(dataset=rows, val_dataset="embedded://arithmetic", recipe="quickstart").config
    assert get_object(c.data.train_files) is rows and c.data.val_files == "embedded://arithmetic"

    class Tok:  # any tokenizer object
        chat_template = None

        def __call__(self, texts):
            return {"input_ids": [[1] for _ in texts]}

    tok = Tok()
    t = Trainer(tokenizer=tok, recipe="quickstart")
    assert get_object(t.config.model.tokenizer_path) is tok
    with pytest.raises(ValueError, match="objects of this Python process"):
        t.command()
    with pytest.raises(TypeError, match="datasets.Dataset"):
        Trainer(dataset=3.5)


def test_model_references_for_critic_and_reward(tmp_path, capsys):
    """critic_model and the reward models take every reference the actor takes; a model object is refused
    with the fix; an in-process object URI on a command line is reported (it lives in another process)."""
    c = Trainer(algorithm="ppo", actor_model="tiny://quickstart", critic_model="tiny://quickstart",
                recipe="quickstart").config
    assert (c.model.path, c.model.critic_path, c.critic.enable) == ("tiny://quickstart", "tiny://quickstart", True)
    c = Trainer(algorithm="ppo", critic_model="Qwen/Qwen2.5-0.5B", reward_model="OpenRLHF/rm-0.5b").config
    assert c.model.critic_path == "Qwen/Qwen2.5-0.5B" and c.reward.sources[0].path == "OpenRLHF/rm-0.5b"

    class FakeModel:
        def save_pretrained(self, path):
            pass

        def __call__(self, *a):
            return 0

    for kw in ({"actor_model": FakeModel()}, {"critic_model": FakeModel()}, {"reward_model": FakeModel()}):
        with pytest.raises(TypeError, match="save_pretrained"):
            Trainer(**kw)
    assert main_cli(["--cfg", "data.train_files=object://dataset/999"]) == 2
    assert "is not an object of this process" in capsys.readouterr().err


def test_version():
    import re

    import rlhf

    setup = (REPO / "setup.py").read_text()
    assert rlhf.__version__ == re.search(r'version="([^"]+)"', setup).group(1)
