"""Shared by the LoRA sync e2e tests (tests/e2e/test_lora_adapter_sync.py, test_lora_moe_sync.py): one process runs a
recipe's trainer with a real SGLang CPU engine, then sets every LoRA adapter's B to large random values, syncs, and
writes what the tests compare (the sync's bytes and metrics, the merged HF export, the engine's greedy outputs)."""
from __future__ import annotations

import json
import sys
import textwrap

import torch

from tests.support.dist_utils import finish_group, start_group

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
    cfg = compose_config(args["overrides"], recipe=args["recipe"])
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
    out["sync_bytes"], out["sync_metrics"] = stats.bytes, stats.metrics()
    out["base_sent"] = rollout.bridge.base_sent
    out["export"] = trainer.export_hf()  # merged: W + alpha/r B A
    prompts = [rollout.tokenizer(t).input_ids for t in args["prompts"]]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12, stop_token_ids=stop_token_ids_for(trainer.model_path))
    out["prompts"], out["stop"] = prompts, list(greedy.stop_token_ids)
    out["engine"] = [s.response_ids for s in rollout.manager.generate(prompts, greedy)]
    with open(args["out"], "w") as f:
        json.dump(out, f)
    close(True)
"""

PROMPTS = ["What is 12 + 7?", "Compute 3 * 4.", "5 - 2 =", "How much is 9 + 9?"]


def run_lora_sync(tmp_path, recipe: str, overrides: list[str], timeout: float, env: dict | None = None):
    """Run DRIVER for `recipe` with `overrides` in a process group of its own; returns (result dict, log path).
    Raises AssertionError (with the log's tail) when the run does not exit 0."""
    driver, result, log = tmp_path / "driver.py", tmp_path / "result.json", tmp_path / "run.log"
    driver.write_text(textwrap.dedent(DRIVER))
    args = {"recipe": recipe, "overrides": overrides, "prompts": PROMPTS, "out": str(result)}
    rc = finish_group(start_group([sys.executable, str(driver), json.dumps(args)], log, env), timeout)
    assert rc == 0, f"exit {rc}:\n{log.read_text()[-6000:]}"
    return json.loads(result.read_text()), log


def hf_greedy(path, prompts, stop, max_new_tokens=12):
    """Hugging Face greedy continuations of `prompts` (token-id lists) by the model at `path`, fp32, each cut after its
    first stop token: list of token-id lists."""
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
