"""A 2-step multi-turn run of the quickstart (tiny model, real SGLang engine, megatron actor and critic) with
verl's keys: ``actor_rollout_ref.rollout.multi_turn.*`` with verl's GSM8K tool config (Gsm8kTool) and interaction
config (Gsm8kInteraction, which answers every model turn until the answer is right).  The turn and tool metrics
are logged every step and every trajectory has more than one turn."""
from __future__ import annotations

import sys
import textwrap

import pytest

from tests.support.dist_utils import run_group
from tests.support.tracking_readers import run_series as scalars

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

TOOL_CONFIG = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
INTERACTION_CONFIG = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""


@pytest.fixture(scope="module")
def tiny_model(quickstart_model):
    return quickstart_model()


def test_two_step_multi_turn_quickstart_logs_turn_and_tool_metrics(tiny_model, tmp_path):
    (tmp_path / "tool.yaml").write_text(TOOL_CONFIG)
    (tmp_path / "interaction.yaml").write_text(INTERACTION_CONFIG)
    out_dir = tmp_path / "run"
    mt = "actor_rollout_ref.rollout.multi_turn"
    cmd = [sys.executable, "-m", "rlhf.main", "recipe=quickstart", f"model.path={tiny_model}",
           "trainer.total_training_steps=2", f"trainer.default_local_dir={out_dir}", "trainer.val_before_train=false",
           "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console,tensorboard]",
           "data.max_response_length=96", "data.train_batch_size=8", "rollout.n=2",
           "data.return_raw_chat=True", f"{mt}.enable=True", f"{mt}.tool_config_path={tmp_path / 'tool.yaml'}",
           f"{mt}.interaction_config_path={tmp_path / 'interaction.yaml'}", f"{mt}.max_user_turns=3"]
    rc, out = run_group(cmd, 900, {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None})
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    s = scalars(str(out_dir))
    for tag in ("num_turns/mean", "num_turns/max", "num_turns/min", "tool_calls/mean", "tool_calls/success_rate",
                "tool_calls/errors", "tool_calls/latency_s/mean", "multi_turn/truncated"):
        assert sorted(s[tag]) == [1, 2], (tag, sorted(s))
    # the interaction answers every wrong model turn: more than one turn per trajectory (num_turns counts the prompt)
    assert all(v >= 3 for v in s["num_turns/min"].values()), s["num_turns/min"]
    assert all(v <= 1 + 4 + 3 for v in s["num_turns/max"].values())  # max_user_turns=3: at most 4 model turns
    assert all(v > 0 for v in s["multi_turn/kwargs_fallbacks"].values())  # the arithmetic rows have no kwargs
    # the trainer's log-probs of the model tokens, computed on the whole multi-turn sequence (user tokens between
    # turns), equal the engine's before the first update: the trained sequence is the one the engine continued
    assert s["actor/rollout_log_prob_diff"][1] < 1e-3, s["actor/rollout_log_prob_diff"]
    print(s["critic/score/mean"], s["actor/rollout_log_prob_diff"], s["response_length/mean"])
    print(textwrap.shorten(str({k: s[k] for k in sorted(s) if k.startswith(("num_turns", "tool_calls", "multi"))}),
                           2000))
