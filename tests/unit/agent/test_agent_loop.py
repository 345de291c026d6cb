"""The agent loop (rlhf/agent/loop.py) over a scripted engine fleet (tests/support/agent_fakes.py): the trained
sequence holds exactly the engine's token ids over several turns, tool / user tokens are the chat template's
incremental rendering with response_mask 0, and bad tool input becomes a message plus a counter."""
from __future__ import annotations

import pytest

from rlhf.agent.config import MultiTurnSettings, ToolSpec
from rlhf.agent.interactions import Gsm8kInteraction
from rlhf.agent.loop import AgentLoop, truncate_tool_text
from rlhf.agent.tools import Gsm8kTool, build_tools
from rlhf.rollout.sampling import SamplingConfig
from rlhf.workers.batch import build_rollout_batch, outcome_token_scores
from tests.support.agent_fakes import GSM8K_SCHEMA, ScriptedFleet, tool_call

def rows(k=2):
    return [{"raw_prompt": [{"role": "user", "content": f"What is {i} + {5 - i}?"}], "ground_truth": "5",
             "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}}}
            for i in range(k)]


def loop(tok, R=400, tools=None, interactions=None, **kw):
    tools = {"calc_gsm8k_reward": Gsm8kTool({}, GSM8K_SCHEMA)} if tools is None else tools
    return AgentLoop(MultiTurnSettings(enable=True, **kw), tok, R, tools=tools, interactions=interactions)


def three_turns(turn, prompt):
    calls = [tool_call("calc_gsm8k_reward", '{"answer": "%s"}' % a) for a in "45"]
    return ["Let me try. " + calls[0], "Again. " + calls[1], "The answer is 5. #### 5"][turn]


def test_trained_tokens_are_the_engines_over_three_turns(tok):
    fleet = ScriptedFleet(tok, three_turns)
    agent = loop(tok)
    samples, m = agent.run(fleet.generate, rows(2), SamplingConfig(n=2, max_new_tokens=400))
    assert len(samples) == 4 and [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0),
                                                                                          (1, 1)]
    assert fleet.waves == [4, 4, 4]  # the four trajectories' turns go to the engines together
    unused = {k: c for k, c in enumerate(fleet.calls)}  # each engine output must appear in exactly one trajectory
    for s in samples:
        mask, spans = s.extra["response_mask"], s.extra["model_spans"]
        assert len(spans) == 3 and s.extra["num_turns"] == 6 and s.finish_reason == "stop"
        assert s.prompt_ids == agent.renderer.prompt(rows(2)[s.prompt_index]["raw_prompt"])
        for a, b in spans:
            # the request of this turn continued from exactly the tokens so far; its output is the trained span
            [k] = [k for k, (p, ids, lps, _) in unused.items() if p == s.prompt_ids + s.response_ids[:a]
                   and ids == s.response_ids[a:b] and lps == s.response_log_probs[a:b]]
            ids = unused.pop(k)[1]
            assert mask[a:b] == [1] * (b - a)
            text = tok.decode(ids, skip_special_tokens=True)
            assert tok(text, add_special_tokens=False)["input_ids"] != ids[:-1]  # a re-encode would differ
        gaps = [(spans[k][1], spans[k + 1][0]) for k in range(2)]
        for (a, b), answer, reward in zip(gaps, ("4", "5"), ("0.0", "1.0")):
            assert mask[a:b] == [0] * (b - a) and s.response_log_probs[a:b] == [0.0] * (b - a)
            assert tok.decode(s.response_ids[a:b]) == (f"<|im_start|>tool\nCurrent parsed answer='{answer}' "
                                                       f"reward={reward}<|im_end|>\n<|im_start|>assistant\n")
        assert sum(mask) == sum(b - a for a, b in spans) and len(mask) == len(s.response_ids)
        assert s.extra["tool_rewards"] == [-0.05, 0.0]  # verl's Gsm8kTool: no better answer -0.05, better 0
    assert not unused
    assert m["num_turns/mean"] == 6 and m["num_turns/min"] == m["num_turns/max"] == 6
    assert m["tool_calls/mean"] == 2 and m["tool_calls/success_rate"] == 1.0 and m["tool_calls/errors"] == 0
    assert m["tool_calls/latency_s/max"] >= 0 and m["multi_turn/truncated"] == 0
    from rlhf.workers.rollout import _trajectory_metrics  # (fully async: the same metrics from the samples alone)

    assert _trajectory_metrics(samples) == {k: m[k] for k in _trajectory_metrics(samples)}

    batch = build_rollout_batch(samples, tok.pad_token_id, 400)
    s = samples[0]
    assert batch["response_mask"][0, :len(s.response_ids)].tolist() == s.extra["response_mask"]
    assert batch["attention_mask"][0, batch["prompt_length"]:].sum() == len(s.response_ids)
    scores = outcome_token_scores([1.0] * 4, batch["response_mask"])
    assert scores[0].nonzero().flatten().tolist() == [s.extra["model_spans"][-1][1] - 1]


def test_response_budget_and_per_turn_limit(tok):
    fleet = ScriptedFleet(tok, three_turns)
    [s], m = loop(tok, R=120, max_tokens_per_turn=60).run(fleet.generate, rows(1), SamplingConfig(max_new_tokens=1))
    assert [c[3] for c in fleet.calls][0] == 60  # min(what is left of R, max_tokens_per_turn)
    assert len(s.response_ids) <= 120 and s.finish_reason == "length" and m["multi_turn/truncated"] == 1
    fleet = ScriptedFleet(tok, three_turns)
    [s], _ = loop(tok, R=20).run(fleet.generate, rows(1), SamplingConfig(max_new_tokens=1))
    assert s.response_ids == fleet.calls[0][1] and len(s.response_ids) == 20 and s.finish_reason == "length"


def test_context_limit(tok):
    """A request's prompt and new tokens stay within the engines' context (the prompt, longer with tool schemas,
    leaves less for the response); a prompt that leaves nothing ends the trajectory, truncated, without a request."""
    fleet = ScriptedFleet(tok, three_turns)
    agent = loop(tok)
    P = len(agent.renderer.prompt(rows(1)[0]["raw_prompt"]))
    agent.max_context = P + 50
    [s], _ = agent.run(fleet.generate, rows(1), SamplingConfig(max_new_tokens=1))
    assert fleet.calls[0][3] == 50 and len(s.response_ids) == 50 and s.finish_reason == "length"
    fleet, agent.max_context = ScriptedFleet(tok, three_turns), P
    [s], m = agent.run(fleet.generate, rows(1), SamplingConfig(max_new_tokens=1))
    assert not fleet.calls and s.response_ids == [] and m["multi_turn/truncated"] == 1


def test_turn_limit(tok):
    fleet = ScriptedFleet(tok, three_turns)
    [s], m = loop(tok, max_assistant_turns=2).run(fleet.generate, rows(1), SamplingConfig(max_new_tokens=1))
    assert len(s.extra["model_spans"]) == 2 and m["multi_turn/turn_limit"] == 1 and s.finish_reason == "stop"


def _one_bad_turn(tok, text, tools=None, **kw):
    fleet = ScriptedFleet(tok, lambda turn, p: text if turn == 0 else "#### 5")
    [s], m = loop(tok, tools=tools, **kw).run(fleet.generate, rows(1), SamplingConfig(max_new_tokens=1))
    a, b = s.extra["model_spans"][0][1], s.extra["model_spans"][1][0]
    return tok.decode(s.response_ids[a:b]), s, m


@pytest.mark.parametrize("text, kind, message", [
    (tool_call("calc_gsm8k_reward", '{"answer": "5"'), "parse_errors", "could not be parsed as JSON"),
    (tool_call("web_search", '{"query": "5"}'), "unknown_tool", "unknown tool 'web_search' (available: "
                                                                "calc_gsm8k_reward)"),
    (tool_call("calc_gsm8k_reward", '[1, 2]'), "invalid_arguments", "are not a JSON object"),
])
def test_bad_tool_calls_become_messages(tok, text, kind, message):
    msg, s, m = _one_bad_turn(tok, text)
    assert msg.startswith("<|im_start|>tool\nError when executing tool: ") and message in msg
    assert m[f"tool_calls/{kind}"] == 1 and m["tool_calls/errors"] == 1 and m["tool_calls/success_rate"] == 0.0
    assert s.extra["num_turns"] == 4 and s.extra["tool_rewards"] == [0.0]


@pytest.mark.parametrize("cls, kind, message", [("RaisingTool", "exceptions", "RuntimeError: sandbox unreachable"),
                                                ("SlowTool", "timeouts", "did not answer within 0.2 s")])
def test_failing_tools_become_messages(tok, cls, kind, message):
    tools = build_tools([ToolSpec(f"tests.support.agent_fakes.{cls}", {}, GSM8K_SCHEMA)])
    msg, _, m = _one_bad_turn(tok, tool_call("calc_gsm8k_reward", '{"answer": "5"}'), tools=tools, tool_timeout_s=0.2)
    assert message in msg and m[f"tool_calls/{kind}"] == 1 and m["tool_calls/errors"] == 1


@pytest.mark.parametrize("side", ["left", "middle", "right"])
def test_huge_tool_output_is_truncated(tok, side):
    tools = build_tools([ToolSpec("tests.support.agent_fakes.HugeTool", {}, GSM8K_SCHEMA)])
    msg, _, m = _one_bad_turn(tok, tool_call("calc_gsm8k_reward", '{"answer": "5"}'), tools=tools,
                              max_tool_response_length=40, tool_response_truncate_side=side)
    full = "".join(chr(ord("a") + k % 26) for k in range(5000))
    want = {"left": full[:40] + "...(truncated)", "right": "(truncated)..." + full[-40:],
            "middle": full[:20] + "...(truncated)..." + full[-20:]}[side]
    assert truncate_tool_text(full, 40, side) == want
    assert msg == f"<|im_start|>tool\n{want}<|im_end|>\n<|im_start|>assistant\n"
    assert m["tool_calls/truncated_responses"] == 1 and m["tool_calls/errors"] == 0


def test_interaction_turns(tok):
    """verl's Gsm8kInteraction: a wrong answer gets the retry message (user tokens, mask 0), the right one ends."""
    fleet = ScriptedFleet(tok, lambda turn, p: ["#### 4", "#### 5"][turn])
    agent = loop(tok, tools={}, interactions={"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}, max_user_turns=5)
    r = rows(1)
    r[0]["extra_info"]["interaction_kwargs"] = {"name": "gsm8k", "ground_truth": "5"}
    [s], m = agent.run(fleet.generate, r, SamplingConfig(max_new_tokens=1))
    assert s.extra["turn_scores"] == [0.0, 1.0] and s.extra["num_turns"] == 5
    (a0, b0), (a1, b1) = s.extra["model_spans"]
    assert tok.decode(s.response_ids[b0:a1]) == ("<|im_start|>user\nYour response is incorrect! You need to reflect "
                                                 "on your answer and try again.<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(s.response_ids[b1:]) == "<|im_start|>user\nYour response is correct!<|im_end|>\n" \
                                              "<|im_start|>assistant\n"
    assert sum(s.extra["response_mask"]) == (b0 - a0) + (b1 - a1) and m["multi_turn/kwargs_fallbacks"] == 0
