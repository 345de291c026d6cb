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

import json
import os
import sys
import textwrap

import pytest
import torch

from tests.support.dist_utils import finish_group, start_group
from tests.support.tracking_readers import run_scalars

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

DRIVER = """
import json, sys

if __name__ == "__main__":  # (SGLang's and dist_checkpointing's processes import this file again)
    import torch
    from parallel.convert import unwrap_model
    from parallel.lora import adapted_layers
    from rlhf.config import compose_config, validate_config
    from rlhf.rollout.sampling import SamplingConfig, stop_token_ids_for
    from rlhf.trainer.ppo_trainer import PPOTrainer

    args = json.loads(sys.argv[1])
    cfg = compose_config(args["overrides"], recipe="quickstart")
    validate_config(cfg, world_size=1, check_files=True)
    trainer = PPOTrainer(cfg)
    close, trainer.close = trainer.close, lambda finished=False: None  # the engines outlive fit()
    trainer.fit()
    rollout, out = trainer.rollout, {}
    out["full_bytes"] = rollout.bridge.plan().total_bytes  # what a sync of the full weights sends
    g = torch.Generator().manual_seed(0)
    adapters = [a for c in trainer.actor.chunks for a in adapted_layers(unwrap_model(c)).values()]
    for a in adapters:  # large: the adapted model's greedy answers differ from the base model's
        a.b.data.copy_(torch.randn(a.b.shape, generator=g) * 0.5)
    stats = rollout.sync_weights()
    out["sync_bytes"], out["base_sent"] = stats.bytes, rollout.bridge.base_sent
    out["export"] = trainer.export_hf()  # merged: W + alpha/r B A
    prompts = [rollout.tokenizer(t).input_ids for t in args["prompts"]]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12, stop_token_ids=stop_token_ids_for(cfg.model.path))
    out["prompts"], out["stop"] = prompts, list(greedy.stop_token_ids)
    out["engine"] = [s.response_ids for s in rollout.manager.generate(prompts, greedy)]
    with open(args["out"], "w") as f:
        json.dump(out, f)
    close(True)
"""

PROMPTS = ["What is 12 + 7?", "Compute 3 * 4.", "5 - 2 =", "How much is 9 + 9?"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf.quickstart.model import build_quickstart_model

    return build_quickstart_model(str(tmp_path_factory.mktemp("tiny") / "model"), warmup_steps=40)


def _hf_greedy(path, prompts, stop, max_new_tokens=12):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop),
                                 pad_token_id=0)[0, len(p):].tolist()
            cut = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
            outs.append(ids[:cut])
    return outs


def test_quickstart_lora_rank8_syncs_adapters_and_engine_equals_merged_model(tiny_model, tmp_path):
    driver, result, log = tmp_path / "driver.py", tmp_path / "result.json", tmp_path / "run.log"
    driver.write_text(textwrap.dedent(DRIVER))
    run = tmp_path / "run"
    overrides = [f"model.path={tiny_model}", f"trainer.default_local_dir={run}", "trainer.total_training_steps=2",
                 "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.progress_bar=false", "trainer.export_hf_at_end=false", "trainer.logger=[console,tensorboard]",
                 "model.lora.rank=8", "model.lora.alpha=16"]
    proc = start_group([sys.executable, str(driver), json.dumps({"overrides": overrides, "prompts": PROMPTS,
                                                                 "out": str(result)})], log)
    rc = finish_group(proc, 900)
    assert rc == 0, f"exit {rc}:\n{open(log).read()[-6000:]}"
    out = json.loads(result.read_text())

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
    merged = _hf_greedy(out["export"], out["prompts"], out["stop"])
    base = _hf_greedy(tiny_model, out["prompts"], out["stop"])
    print("engine", out["engine"], "\nmerged", merged, "\nbase", base)
    assert out["engine"] == merged
    assert merged != base
