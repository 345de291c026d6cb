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

import json
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
    cfg = compose_config(args["overrides"], recipe="moe_r3_tiny_cpu")
    validate_config(cfg, world_size=1, check_files=True)
    trainer = PPOTrainer(cfg)
    close, trainer.close = trainer.close, lambda finished=False: None  # the engines outlive fit()
    trainer.fit()
    rollout, out = trainer.rollout, {"base_path": trainer.model_path}
    out["full_bytes"] = rollout.bridge.plan().total_bytes  # what a sync of the full weights sends
    g = torch.Generator().manual_seed(0)
    adapters = [a for c in trainer.actor.chunks for a in adapted_layers(unwrap_model(c)).values()]
    out["expert_adapters"] = sum(a.expert_groups is not None for a in adapters)
    for a in adapters:  # large: the adapted model's greedy answers differ from the base model's
        a.b.data.copy_(torch.randn(a.b.shape, generator=g) * 0.5)
    stats = rollout.sync_weights()
    out["sync_metrics"] = stats.metrics()
    out["export"] = trainer.export_hf()  # merged: W + alpha/r B A
    prompts = [rollout.tokenizer(t).input_ids for t in args["prompts"]]
    stop = stop_token_ids_for(trainer.model_path)
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12, stop_token_ids=stop)
    out["prompts"], out["stop"] = prompts, list(greedy.stop_token_ids)
    out["engine"] = [s.response_ids for s in rollout.manager.generate(prompts, greedy)]
    with open(args["out"], "w") as f:
        json.dump(out, f)
    close(True)
"""

PROMPTS = ["What is 12 + 7?", "Compute 3 * 4.", "5 - 2 =", "How much is 9 + 9?"]


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


def test_moe_expert_lora_syncs_merged_and_engine_equals_merged_model(tmp_path):
    driver, result, log = tmp_path / "driver.py", tmp_path / "result.json", tmp_path / "run.log"
    driver.write_text(textwrap.dedent(DRIVER))
    run = tmp_path / "run"
    overrides = [f"trainer.default_local_dir={run}", "trainer.total_training_steps=2", "trainer.save_freq=-1",
                 "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.progress_bar=false",
                 "trainer.export_hf_at_end=false", "trainer.logger=[console,tensorboard]",
                 "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                 "actor.router_replay.mode=disabled", "rollout.enable_rollout_routing_replay=false",
                 "rollout.dtype=float32",  # the engine as HF (the recipe's is bf16): greedy outputs comparable
                 "model.lora.rank=8", "model.lora.alpha=16", "model.lora.target_modules=all-linear"]
    env = {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}  # one process, not a torchrun rank
    proc = start_group([sys.executable, str(driver), json.dumps({"overrides": overrides, "prompts": PROMPTS,
                                                                 "out": str(result)})], log, env)
    rc = finish_group(proc, 1500)
    assert rc == 0, f"exit {rc}:\n{open(log).read()[-6000:]}"
    out = json.loads(result.read_text())
    assert out["expert_adapters"] == 2 * 8 * 2  # 2 layers x 8 experts x (fc1, fc2)

    # merged fallback: the full weights every sync, counted
    scalars = run_scalars(str(run))
    per_step = [scalars[("weight_sync/bytes", k)] for k in (1, 2)]
    flags = [scalars[("weight_sync/lora_merged_fallback", k)] for k in (1, 2)]
    print(f"\nweight_sync/bytes per step {per_step} (a full sync {out['full_bytes']}), "
          f"after the perturbation {out['sync_metrics']}")
    assert per_step == [out["full_bytes"]] * 2 and flags == [1.0, 1.0]
    assert out["sync_metrics"]["weight_sync/lora_merged_fallback"] == 1.0
    assert "merged weights" in open(log).read()  # the fallback's one warning

    # the engine's greedy output = HF's greedy output of the merged export, != the base model's
    merged = _hf_greedy(out["export"], out["prompts"], out["stop"])
    base = _hf_greedy(out["base_path"], out["prompts"], out["stop"])
    print("engine", out["engine"], "\nmerged", merged, "\nbase", base)
    assert out["engine"] == merged
    assert merged != base
