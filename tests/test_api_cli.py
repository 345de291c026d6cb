"""Python API (`rlhf.Trainer`), the `rlhf launch` command, and the per-algorithm recipes: config
building, validation and launch commands (no training here; see tests/test_algorithms_e2e.py).
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

REPO = Path(__file__).resolve().parents[1]
# recipe -> trainer processes it is written for
RECIPES = {"grpo_tiny_cpu": 1, "rloo_tiny_cpu": 1, "reinforce_pp_tiny_cpu": 1, "dapo_tiny_cpu": 1,
           "dpo_tiny_cpu": 1, "grpo_qwen2_7b": 8, "dapo_qwen2_7b": 8, "dpo_qwen2_7b": 8}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)


# --------------------------------------------------------------------------- Python API


def test_trainer_builds_the_recipe_config_with_overrides(tmp_path):
    t = Trainer(algorithm="grpo", recipe="quickstart", actor_model="/models/actor", dataset="embedded://arithmetic",
                output_dir=tmp_path / "out", total_training_steps=3, actor__optim__lr=2e-4,
                **{"rollout.val_kwargs.temperature": 1.0})
    c = t.config
    assert c.algorithm.adv_estimator == "grpo" and c.critic.enable is None  # quickstart's critic switched off
    assert c.model.path == "/models/actor" and c.trainer.default_local_dir == str(tmp_path / "out")
    assert c.data.train_files == c.data.val_files == "embedded://arithmetic"
    assert c.trainer.total_training_steps == 3 and c.actor.optim.lr == 2e-4
    assert c.rollout.val_kwargs.temperature == 1.0
    assert c.rollout.n == compose_config([], recipe="quickstart").rollout.n >= 2  # the recipe's n is kept
    # the same config as the command line
    assert compose_config(t.overrides, recipe="quickstart") == c
    cmd = t.command(nproc=2)
    assert cmd[:6] == ["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=2", "-m", "rlhf.main"]
    assert cmd[6] == "recipe=quickstart" and "model.path=/models/actor" in cmd


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
    rc = cli_main(["launch", "--algorithm", "dapo", "--model_name_or_path", "/models/q7", "--dataset_name",
                   str(data), "--output_dir", "out/dapo", "--slurm", "trainer.save_freq=5"])
    out = capsys.readouterr().out.strip()
    assert rc == 0 and out.startswith(f"cd {REPO} && sbatch recipes/dapo_qwen2_7b/run_slurm.sbatch ")
    assert f"data.train_files={data}" in out and f"trainer.default_local_dir={os.path.abspath('out/dapo')}" in out
    assert "algorithm=dapo" in out and "trainer.save_freq=5" in out
    assert "recipe=" not in out.split("run_slurm.sbatch")[1]  # the sbatch script names its recipe
    assert (REPO / "recipes/dapo_qwen2_7b/run_slurm.sbatch").is_file()
    rc = cli_main(["launch", "--algorithm", "dpo", "--slurm"])
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
