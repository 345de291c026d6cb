"""LoRA on MoE experts through the real trainer and a real SGLang CPU engine (recipe moe_r3_tiny_cpu: the tiny
Qwen3-MoE tiny://quickstart-moe, GRPO), one process, ``model.lora.target_modules=all-linear`` with verl's default
``lora.merge=false``:

* SGLang 0.5.23 applies MoE expert adapters only in Triton/CUDA kernels (docs/lora.md), so the engine starts without
  SGLang LoRA and every sync sends the merged weights: ``weight_sync/bytes`` is the full model's each step and
  ``weight_sync/lora_merged_fallback`` is 1;
* after the run every adapter's B (attention and all 16 routed experts' fc1/fc2) is set to large random values and
  synced: the engine's greedy output then equals Hugging Face's greedy output of the trainer's merged export
  (W + alpha/r B A, parallel.convert), and differs from the base model's (the expert adapters reach the engine).
About 6 minutes on a loaded 2-core machine.
"""
from __future__ import annotations

import pytest

from tests.support.lora_sync import hf_greedy, run_lora_sync
from tests.support.tracking_readers import run_scalars

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def test_moe_expert_lora_syncs_merged_and_engine_equals_merged_model(tmp_path):
    run = tmp_path / "run"
    overrides = [f"trainer.default_local_dir={run}", "trainer.total_training_steps=2", "trainer.save_freq=-1",
                 "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.progress_bar=false",
                 "trainer.export_hf_at_end=false", "trainer.logger=[console,tensorboard]",
                 "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                 "actor.router_replay.mode=disabled", "rollout.enable_rollout_routing_replay=false",
                 "rollout.dtype=float32",  # the engine as HF (the recipe's is bf16): greedy outputs comparable
                 "model.lora.rank=8", "model.lora.alpha=16", "model.lora.target_modules=all-linear"]
    env = {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}  # one process, not a torchrun rank
    out, log = run_lora_sync(tmp_path, "moe_r3_tiny_cpu", overrides, 1500, env)
    assert out["expert_adapters"] == 2 * 8 * 2  # 2 layers x 8 experts x (fc1, fc2)

    # merged fallback: the full weights every sync, counted
    scalars = run_scalars(str(run))
    per_step = [scalars[("weight_sync/bytes", k)] for k in (1, 2)]
    flags = [scalars[("weight_sync/lora_merged_fallback", k)] for k in (1, 2)]
    print(f"\nweight_sync/bytes per step {per_step} (a full sync {out['full_bytes']}), "
          f"after the perturbation {out['sync_metrics']}")
    assert per_step == [out["full_bytes"]] * 2 and flags == [1.0, 1.0]
    assert out["sync_metrics"]["weight_sync/lora_merged_fallback"] == 1.0
    assert "merged weights" in log.read_text()  # the fallback's one warning

    # the engine's greedy output = HF's greedy output of the merged export, != the base model's
    merged = hf_greedy(out["export"], out["prompts"], out["stop"])
    base = hf_greedy(out["base_path"], out["prompts"], out["stop"])
    print("engine", out["engine"], "\nmerged", merged, "\nbase", base)
    assert out["engine"] == merged
    assert merged != base
