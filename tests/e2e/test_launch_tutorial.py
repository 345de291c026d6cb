"""The tutorial's launch command, run for real on CPU (slow): ``rlhf launch --algorithm ppo --model_name_or_path M
--reward_model_name_or_path R --dataset_name D --per_device_train_batch_size ... --output_dir O --logging_steps ...
--save_steps ...`` with a local tiny model, a tiny reward model and local prompts, at TP2 on two processes.  Then
the run's outputs: log lines with time and rank (no library warning greeting), metrics, histograms and the
generations table in TensorBoard; and its TP2 checkpoint converted with ``scripts/convert_checkpoint.py
mcore-to-hf --ckpt`` to an HF directory that transformers loads, with logits equal to the trainer's HF export."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.support import tracking_readers as read
from tests.support.dist_utils import run_group


pytestmark = [pytest.mark.slow, pytest.mark.sglang]

PROMPTS = ["Write a haiku about rain.", "Say hi.", "Name a color.", "Count to three.", "What is 2+2?",
           "Describe the sea.", "Give me a word.", "Tell a joke."]


def _run(cmd, timeout):
    """Run in its own process group (tests/dist_utils.run_group); returns (exit code, output)."""
    # RAY_memory_monitor_refresh_ms=0: Ray's OOM killer is off, so a busy shared test machine does not kill the
    # engine (a real out-of-memory still fails the run)
    return run_group(cmd, timeout, {"RAY_memory_monitor_refresh_ms": "0", "RLHF_SHOW_ALL_WARNINGS": None})


def test_tutorial_launch_runs_and_its_tp2_checkpoint_converts_to_hf(tmp_path):
    from rlhf.quickstart.model import build_quickstart_model
    from tests.unit.rewards.test_reward_sources import make_tiny_rm

    model = build_quickstart_model(str(tmp_path / "model"), warmup_steps=5)
    rm = make_tiny_rm(tmp_path / "rm")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    rc, log = _run([sys.executable, "-m", "rlhf.cli", "launch", "--algorithm", "ppo", "--model_name_or_path", model,
                    "--reward_model_name_or_path", rm, "--dataset_name", str(data),
                    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                    "--num_rollout_samples", "4", "--output_dir", str(out), "--logging_steps", "1", "--save_steps", "2",
                    "--nproc", "2", "parallel.tensor_model_parallel_size=2", "trainer.total_training_steps=2",
                    "data.max_response_length=8", "data.max_val_samples=4", "trainer.test_freq=2",
                    "trainer.log_val_generations=2", "trainer.progress_bar=false",
                    # a busy shared machine must not time the reward model out (all samples unscorable)
                    "reward.timeout_s=600"], timeout=1500)
    (tmp_path / "launch.log").write_text(log)
    assert rc == 0, log[:3000] + "\n...\n" + log[-5000:]
    # logging: time + rank on INFO lines, the metrics line, no library warning greeting
    assert "[rank 0] INFO rlhf.metrics: step 2:" in log, log[-3000:]
    for noise in ("Transformer Engine and Apex are not installed", "cuda_graph_scope", "Params for bucket",
                  "CUDA_DEVICE_MAX_CONNECTIONS", "Creating parquet from Arrow", "support AWQ currently",
                  "support GGUF quantization"):
        assert noise not in log, noise

    tb = read.tensorboard(str(out / "tensorboard"))
    keys = {k for k, _ in tb["scalars"]}
    assert {("critic/score/mean", 1), ("critic/score/mean", 2), ("val/score", 2)} <= set(tb["scalars"])
    assert {"val/prompts/score", "perf/rollout_tokens_per_s", "critic/vf_loss"} <= keys  # data_source: the file
    assert ("critic/score/hist", 2) in tb["histograms"] and ("response_length/hist", 2) in tb["histograms"]
    assert tb["text"][("val/generations", 2)].count("\n") == 3  # header, rule, 2 rows
    assert (out / "config.yaml").is_file() and (out / "checkpoints" / "global_step_2" / "actor").is_dir()

    conv = tmp_path / "converted"
    rc, clog = _run([sys.executable, "scripts/convert_checkpoint.py", "mcore-to-hf", "--ckpt",
                     str(out / "checkpoints" / "global_step_2"), "--out", str(conv)], timeout=600)
    assert rc == 0, clog[-4000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = AutoModelForCausalLM.from_pretrained(str(conv), dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(out / "hf_export"), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(conv))("What is 2+2? Say hi.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.equal(la, lb)  # the step-2 checkpoint is what the run exported at its end (step 2)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.equal(base(ids).logits, la)  # ... and it is the trained actor, not the start
