"""The scale-down of tests/support/verl_run2.py (``python -m tests.support.verl_examples --run2``): the overrides it
appends to verl's example commands, and that an example so scaled down composes to a 2-step, one-process CPU job
(in-process ``--cfg``; the 2-step runs themselves are not run here: docs/verl.md reports them)."""
from __future__ import annotations

import yaml

from tests.support.verl_examples import count_paths, examples, run_cfg
from tests.support.verl_run2 import SCALE_DOWN, first_error, scale_down

PATHS = {"train": "/d/train.parquet", "test": "/d/test.parquet", "model": "tiny://quickstart", "ckpt": "/c",
         "mcore": "/m"}


def test_scale_down_fills_paths_and_caps_n():
    out = scale_down(["actor_rollout_ref.rollout.n=5", "data.train_batch_size=1024"], PATHS)
    assert len(out) == len(SCALE_DOWN)
    assert "actor_rollout_ref.rollout.n=2" in out and "data.train_files=/d/train.parquet" in out
    assert "actor_rollout_ref.model.path=tiny://quickstart" in out and "trainer.default_local_dir=/c" in out
    assert "critic.megatron.pipeline_model_parallel_size=1" in out and "trainer.total_training_steps=2" in out
    assert not any("{" in o for o in out)
    # n: the script's, at most 2; 1 when it sets none (PPO's default)
    assert "actor_rollout_ref.rollout.n=1" in scale_down([], PATHS)
    assert "actor_rollout_ref.rollout.n=1" in scale_down(["actor_rollout_ref.rollout.n=1"], PATHS)
    assert "actor_rollout_ref.rollout.n=2" in scale_down(["actor_rollout_ref.rollout.n=8",
                                                          "actor_rollout_ref.rollout.n=3"], PATHS)


def test_scale_down_reward_model():
    """A reward model gets the tiny model too; none is added where the script has none."""
    assert "reward_model.model.path=tiny://quickstart" in scale_down(["reward_model.enable=True"], PATHS)
    assert not any(o.startswith("reward_model.") for o in scale_down(["reward_model.enable=False"], PATHS))


def test_scale_down_overlong_buffer_fits_the_response():
    """DAPO's overlong buffer (4096 tokens in verl's scripts) must fit in the 32-token response."""
    out = scale_down(["+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
                      "+reward_model.reward_kwargs.max_resp_len=8192"], PATHS)
    assert "reward_model.reward_kwargs.overlong_buffer_cfg.len=8" in out
    assert "reward_model.reward_kwargs.max_resp_len=32" in out and "data.max_response_length=32" in out
    assert not any("overlong_buffer" in o or "max_resp_len" in o for o in scale_down([], PATHS))


def test_scaled_down_example_composes_to_two_cpu_steps(tmp_path, monkeypatch):
    """verl's GSM8K PPO example (8 GPUs, batch 1024, rollout TP 2) scaled down: one process, batch 4, 2 steps."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    paths = count_paths(tmp_path)
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    ex = examples()["ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh"]
    code, out, err = run_cfg(["--cfg", *ex["options"], *(o.format(**paths) for o in ex["overrides"]),
                              *scale_down(ex["overrides"], paths)])
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["data"]["train_batch_size"] == 4 and cfg["data"]["max_response_length"] == 32
    assert cfg["trainer"]["total_training_steps"] == 2 and cfg["trainer"]["n_gpus_per_node"] == 1
    assert cfg["rollout"]["n"] == 1 and cfg["rollout"]["tensor_model_parallel_size"] == 1
    assert cfg["model"]["path"] == "tiny://quickstart" and cfg["actor"]["ppo_mini_batch_size"] == 4


def test_scale_down_turns_gpu_optimizer_options_off_on_cpu():
    pre = "actor_rollout_ref.actor.optim.override_optimizer_config."
    out = scale_down([f"+{pre}optimizer_cpu_offload=True", f"+{pre}use_precision_aware_optimizer=True"], PATHS)
    assert f"{pre}optimizer_cpu_offload=False" in out and f"{pre}use_precision_aware_optimizer=False" in out
    assert not any(o.startswith(pre) for o in scale_down([f"+{pre}optimizer_cpu_offload=False"], PATHS))


def test_first_error_names_the_exception_not_hydras_banner():
    log = "Error executing job with overrides: ['a=1']\nTraceback (most recent call last):\n  File x\n" \
          "ValueError: actor.optim.optimizer_cpu_offload=true needs a CUDA device\n"
    assert first_error(log) == "ValueError: actor.optim.optimizer_cpu_offload=true needs a CUDA device"
    assert first_error("Invalid config (1 problem):\n  - data.x=1 is bad\n") == "- data.x=1 is bad"
