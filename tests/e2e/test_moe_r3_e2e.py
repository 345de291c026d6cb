"""MoE routing replay through the PPO trainer with a real SGLang CPU engine (recipe moe_r3_tiny_cpu: the tiny
Qwen3-MoE tiny://quickstart-moe, GRPO), one trainer and one engine for three modes in turn:

* step 1, R3: the engine returns every token's routed experts, the old-log-prob and update forwards replay them:
  ``moe/routing_agreement`` is 1.0 and the trainer's log-probs equal the engine's (|diff| <= 1e-5 per token mean);
* step 2, R2: the update replays the old-log-prob forward's routing (the update refuses a batch without it);
* step 3, disabled: nothing is replayed and the engine's routing still gives the metric: >= 0.99 (both fp32).

The R3-vs-none numbers over more steps: benchmarks/moe_r3.py (benchmarks/runs/2026-12-06-moe-r3.md).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

DRIVER = """
import json, sys
from rlhf.config import compose_config, validate_config
from rlhf.trainer.ppo_trainer import PPOTrainer

cfg = compose_config(json.loads(sys.argv[1]), recipe="moe_r3_tiny_cpu")
validate_config(cfg, world_size=1, check_files=True)
trainer = PPOTrainer(cfg)
try:
    for step, mode in ((1, "R3"), (2, "R2"), (3, "disabled")):
        trainer.actor.router_replay = mode
        m = trainer.train_step(step)
        keep = ("moe/", "actor/rollout_log_prob_diff", "actor/pg_loss", "training/rollout_probs_diff_max")
        print("STEP " + json.dumps({k: float(v) for k, v in m.items() if k.startswith(keep)}), flush=True)
finally:
    trainer.close()
"""


def test_r3_r2_and_disabled_through_the_trainer(tmp_path):
    overrides = [f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[console]",
                 "trainer.progress_bar=false", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                 "rollout.dtype=float32"]  # both fp32 (the recipe's engine is bf16): the 1e-5 and 0.99 bounds
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    env = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), json.dumps(overrides)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    steps = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("STEP ")]
    assert len(steps) == 3, out[-3000:]
    r3, r2, off = steps
    assert r3["moe/routing_agreement"] == 1.0
    assert r3["actor/rollout_log_prob_diff"] <= 1e-5
    assert "moe/routing_agreement" not in r2 or 0.0 <= r2["moe/routing_agreement"] <= 1.0
    assert math.isfinite(r2["actor/pg_loss"])
    # engine and trainer both fp32: without replay they still route alike, which pins the alignment of the engine's
    # routing with the batch's tokens (one position off, ~1 in 28 pairs of 2 experts of 8 would agree)
    assert off["moe/routing_agreement"] >= 0.99 and math.isfinite(off["actor/pg_loss"])
