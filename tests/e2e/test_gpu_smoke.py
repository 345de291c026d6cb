"""scripts/gpu_smoke.py: the product path (`python -m rlhf.main recipe=gpu_smoke`, then a resume), every CHECK
line a test.

* the `gpu` test runs it on one GPU (skipped without CUDA);
* the `slow` CPU dry run runs the same recipe and checks with the CPU engine and gloo (what CI can do); it is
  also the CPU test of the critic warm-up step through the trainer (colocated, validation after it);
* the command lines of --gpus 2 (only checkable on GPUs) are checked for their layout here.
"""
import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.py")
CHECKS = ["exit_codes", "step_metrics_1_3", "actor_metrics_2_3", "critic_warmup_step_1", "generation_after_warmup",
          "checkpoint_written", "resumed", "step_4_after_resume"]


def run_smoke(*args, timeout: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    checks = {"_out": out, "_rc": proc.returncode}
    for line in out.splitlines():
        if line.startswith("CHECK "):
            parts = line.split(" ", 3)
            checks[parts[1]] = (parts[2] == "PASS", parts[3] if len(parts) > 3 else "")
    return checks


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _assert_all_pass(checks):
    missing = [c for c in CHECKS if c not in checks]
    assert not missing, f"checks did not run: {missing}\n{checks['_out'][-6000:]}"
    failed = {c: checks[c][1] for c in CHECKS if not checks[c][0]}
    assert not failed and checks["_rc"] == 0, f"{failed}\n{checks['_out'][-6000:]}"
    assert "SUMMARY 8 passed, 0 failed" in checks["_out"]


@pytest.mark.gpu
def test_gpu_smoke_on_one_gpu(tmp_path):
    if not _cuda():
        pytest.skip("no CUDA device")
    _assert_all_pass(run_smoke("--workdir", str(tmp_path), timeout=1800))


@pytest.mark.slow
def test_cpu_dry_run_passes_every_check(tmp_path):
    """Also the CPU quickstart's critic warm-up through the trainer (colocated engine, trainer.critic_warmup=1,
    trainer.test_freq=1): step 1 trained only the critic and synced nothing, the validation right after it
    (which syncs first: RolloutWorker.ensure_resident) and after step 2 generated on synced weights (the manager refuses resumed-but-unsynced weights:
    rlhf.rollout.manager.WeightsDiscardedError, so the run would fail), step 2 updated the actor."""
    _assert_all_pass(run_smoke("--device", "cpu", "--workdir", str(tmp_path), timeout=1800))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_smoke_run import read_scalars

    s = read_scalars(str(tmp_path / "cpu"))
    assert 1 not in s.get("actor/pg_loss", {}) and 1 in s["critic/vf_loss"]  # step 1 trained only the critic
    assert 2 in s["actor/pg_loss"]
    assert {1, 2} <= set(s["val/score"])  # validation right after the warm-up step, and after step 2
    assert 1 not in s.get("timing_s/update_weights", {})  # the warm-up step syncs nothing; the validation after it does


def test_two_gpu_command_lines(tmp_path):
    """--gpus 2: DP2, TP2 and CP2 through torchrun with 2 ranks, disaggregated with 1 trainer rank (the engine
    takes the other GPU); each a first run and a resume to step 4 in its own run directory."""
    out = run_smoke("--gpus", "2", "--print-commands", "--workdir", str(tmp_path), timeout=120)["_out"]
    lines = [ln for ln in out.splitlines() if "rlhf.main" in ln]
    assert len(lines) == 8, out
    dp2, tp2, cp2, dis = lines[0], lines[2], lines[4], lines[6]
    assert "--nproc_per_node=2" in cp2 and "parallel.context_parallel_size=2" in cp2
    assert "--nproc_per_node=2" in dp2 and "tensor_model_parallel_size" not in dp2
    assert "--nproc_per_node=2" in tp2 and "parallel.tensor_model_parallel_size=2" in tp2
    assert "torch.distributed.run" not in dis and "rollout.mode=disaggregated" in dis
    for first, second in zip(lines[0::2], lines[1::2]):
        assert second == first + " trainer.total_training_steps=4"
        assert "recipe=gpu_smoke" in first and "model.dtype" not in first


def test_script_skips_cleanly_without_cuda(tmp_path):
    if _cuda():
        pytest.skip("CUDA present: the gpu test runs the script for real")
    checks = run_smoke("--workdir", str(tmp_path), timeout=300)
    assert checks["_rc"] == 0 and "SKIP no CUDA device" in checks["_out"], checks["_out"]
