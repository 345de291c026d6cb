"""LoRA synced as adapters (model.lora.merge=false, verl's default) through the real quickstart: megatron actor with
LoRA rank 8, a real SGLang CPU engine (enable_lora), the real WeightBridge and RolloutWorker, one process.

* every sync of the 2 training steps sends the adapters alone (the engine started from the base weights):
  ``weight_sync/bytes`` equals the adapters' bytes (PEFT layout, fp32) and is under half of a full sync's bytes
  (the bridge's own plan of the full weights, what the run without LoRA sends each step);
* after the run the adapters are set to large random values and synced again: the engine's greedy output then
  equals Hugging Face's greedy output of the trainer's merged export (W + alpha/r B A, parallel.convert), and
  differs from the base model's (so the adapter is used, not just loaded).
"""
from __future__ import annotations

import os

import pytest

from tests.support.lora_sync import hf_greedy, run_lora_sync
from tests.support.tracking_readers import run_scalars

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def tiny_model(quickstart_model):
    return quickstart_model(warmup_steps=40)


def test_quickstart_lora_rank8_syncs_adapters_and_engine_equals_merged_model(tiny_model, tmp_path):
    run = tmp_path / "run"
    overrides = [f"model.path={tiny_model}", f"trainer.default_local_dir={run}", "trainer.total_training_steps=2",
                 "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.progress_bar=false", "trainer.export_hf_at_end=false", "trainer.logger=[console,tensorboard]",
                 "model.lora.rank=8", "model.lora.alpha=16"]
    out, _ = run_lora_sync(tmp_path, "quickstart", overrides, 900)

    # bytes: the adapters alone, every sync, under half of a full sync
    from safetensors.torch import load_file

    adapter = load_file(os.path.join(out["export"] + "_adapter", "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * 4 for t in adapter.values())  # fp32 actor: the bytes the bridge sends
    scalars = run_scalars(str(run))
    per_step = [scalars[("weight_sync/bytes", k)] for k in (1, 2)]
    print(f"\nweight_sync/bytes per step {per_step}, after the perturbation {out['sync_bytes']}, adapters "
          f"{adapter_bytes}, a full sync {out['full_bytes']}")
    assert per_step == [adapter_bytes, adapter_bytes] and out["sync_bytes"] == adapter_bytes
    assert adapter_bytes < out["full_bytes"] / 2
    assert out["base_sent"]

    # the engine's greedy output with the adapter = HF's greedy output of the merged export, != the base model's
    merged = hf_greedy(out["export"], out["prompts"], out["stop"])
    base = hf_greedy(tiny_model, out["prompts"], out["stop"])
    print("engine", out["engine"], "\nmerged", merged, "\nbase", base)
    assert out["engine"] == merged
    assert merged != base
