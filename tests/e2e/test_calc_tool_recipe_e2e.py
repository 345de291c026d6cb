"""Recipe calc_tool_tiny_cpu for 2 steps (real SGLang engine, megatron actor, the agent loop with the calculator):
the turn and tool metrics are logged every step, the data's tools_kwargs are used (no fallback), every trajectory
has the tool's turn, and the trainer's log-probs of the multi-turn sequences equal the engine's before the first
update.  A short warm-up (model.warmup_steps=150 instead of the recipe's 600) keeps it fast; the learning claim
(score and tool-call success rate, first steps against last) is measured in benchmarks/runs/2026-12-06-calc-tool.md,
not here."""
from __future__ import annotations

import sys

import pytest

from tests.support.dist_utils import run_group
from tests.support.tracking_readers import run_series as scalars

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def test_two_steps_of_the_calc_tool_recipe_log_turn_and_tool_metrics(tmp_path):
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlhf.main", "recipe=calc_tool_tiny_cpu", "trainer.total_training_steps=2",
           f"trainer.default_local_dir={out_dir}", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.logger=[console,tensorboard]", "trainer.progress_bar=false", "model.warmup_steps=150",
           "data.train_batch_size=8", "data.embedded_num_train=64"]
    rc, out = run_group(cmd, 900, {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None})
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    s = scalars(str(out_dir))
    for tag in ("num_turns/mean", "num_turns/max", "num_turns/min", "tool_calls/mean", "tool_calls/success_rate",
                "tool_calls/errors", "tool_calls/unknown_tool", "tool_calls/tool_errors", "tool_calls/latency_s/mean",
                "multi_turn/truncated", "critic/score/mean"):
        assert sorted(s[tag]) == [1, 2], (tag, sorted(s))
    assert all(v == 0 for v in s["multi_turn/kwargs_fallbacks"].values())  # embedded://calc rows carry tools_kwargs
    # even 150 warm-up steps teach the call format: (nearly) every trajectory calls, some calls name `calc` and get
    # its answer (measured: tool_calls/mean 0.97 and 1.0, success_rate 0.26 and 0.31)
    assert all(v >= 0.8 for v in s["tool_calls/mean"].values()), s["tool_calls/mean"]
    assert all(v > 0 for v in s["tool_calls/success_rate"].values()), s["tool_calls/success_rate"]
    assert all(v >= 3.5 for v in s["num_turns/mean"].values()), s["num_turns/mean"]
    assert all(v <= 4 for v in s["num_turns/max"].values())  # max_assistant_turns=2: call, tool, answer
    assert s["actor/rollout_log_prob_diff"][1] < 1e-3, s["actor/rollout_log_prob_diff"]
    print({k: dict(s[k]) for k in sorted(s) if k.startswith(("num_turns", "tool_calls", "critic/score"))})
