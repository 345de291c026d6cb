"""The calculator tool (rlhf/agent/calculator.py) and the calculator task of recipe calc_tool_tiny_cpu
(rlhf/quickstart/calc.py): values, bad input becomes the tool's "Error: ..." answer (never an exception) and a
tool_calls/tool_errors count in the agent loop, and the warm-up lays out a trajectory token for token as the agent
loop does."""
from __future__ import annotations

import asyncio

import pytest

from rlhf.agent.calculator import CalcError, CalculatorTool, format_number, safe_eval
from rlhf.agent.config import MultiTurnSettings, load_tool_specs
from rlhf.agent.loop import AgentLoop
from rlhf.agent.tools import build_tools
from rlhf.quickstart.calc import (CALC_TOOL_SCHEMA, calc_call_text, calc_tool_specs, calc_warmup_examples,
                                  make_calc_dataset)
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import RolloutSample
from tests.support.paths import REPO

RECIPE_TOOLS = REPO / "recipes" / "calc_tool_tiny_cpu" / "tool_config" / "calc_tool_config.yaml"


@pytest.mark.parametrize("expr, value", [("37*48", 1776), ("7/2", 3.5), ("2**10", 1024), ("-(3+4)*2", -14),
                                         ("17//5", 3), ("17%5", 2), ("1.5*4", 6.0), (" 99 * 99 ", 9801),
                                         ("10-3-2", 5), ("2*3+4*5", 26)])
def test_values(expr, value):
    v = safe_eval(expr)
    assert v == value and type(v) is type(value)


def test_format_number():
    assert [format_number(v) for v in (1776, 6.0, 3.5, 1 / 3, -14)] == ["1776", "6", "3.5", "0.3333333333", "-14"]


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('id')", "Call is not allowed"), ("a+1", "Name is not allowed"),
    ("'ab'*3", "the literal 'ab' is not allowed"), ("(1).real", "Attribute is not allowed"),
    ("1/0", "division by zero"), ("7%0", "division by zero"), ("2**1000", "exponent 1000 is larger than 64"),
    ("9**64*9**64", "more than 60 digits"), ("1+", "is not an arithmetic expression"), ("", "empty"),
    ("1+" * 150 + "1", "at most 200"), ("[1, 2]", "List is not allowed"), ("True+1", "the literal True"),
    ("(-8)**0.5", "not a real number"),
])
def test_bad_input_is_refused_with_the_reason(expr, why):
    with pytest.raises(CalcError, match=None) as e:
        safe_eval(expr)
    assert why in str(e.value), str(e.value)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("params, text, error", [
    ({"expression": "37*48"}, "1776", None), ({"expression": 12}, "12", None),
    ({"expression": "open('x')"}, "Error: Call is not allowed (only numbers, + - * / // % ** and parentheses)", True),
    ({}, "Error: missing argument 'expression' (got [])", True), ({"expression": ["1"]}, "Error: the expression must "
                                                                 "be a string, got list ['1']", True),
    ({"expr": "1+1"}, "Error: missing argument 'expression' (got ['expr'])", True),
])
def test_tool_answers_bad_input_with_a_message(params, text, error):
    tool = CalculatorTool({}, CALC_TOOL_SCHEMA)
    iid, _ = run(tool.create())
    resp, reward, metrics = run(tool.execute(iid, params))
    assert resp.text == text and reward == 0.0 and bool(metrics.get("error")) == bool(error)


def test_recipe_tool_config_builds_the_calculator():
    specs = load_tool_specs(str(RECIPE_TOOLS))
    assert [s.tool_schema for s in specs] == [CALC_TOOL_SCHEMA] == [s.tool_schema for s in calc_tool_specs()]
    tools = build_tools(specs)
    assert isinstance(tools["calc"], CalculatorTool) and tools["calc"].argument == "expression"


@pytest.fixture(scope="module")
def tok():
    from rlhf.quickstart.calc import CALC_BUILD
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer

    return make_quickstart_tokenizer(CALC_BUILD["vocab_size"], calc=True)


class TokenFleet:
    """The engine fleet's generate: turn 0 answers ``calls[prompt]``, turn 1 ``"#### <answer>"`` (tokenized as the
    tokenizer does, EOS appended)."""

    def __init__(self, tok, first, second):
        self.tok, self.first, self.second = tok, first, second
        self.assistant = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    def generate(self, prompts, sampling):
        out = []
        for i, p in enumerate(prompts):
            k = len(self.assistant)
            turn = sum(list(p[j:j + k]) == self.assistant for j in range(len(p) - k + 1)) - 1
            text = (self.first if turn == 0 else self.second)(self.tok.decode(p))
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(RolloutSample(list(p), ids, [-0.5] * len(ids), "stop", i, 0))
        return out


def agent(tok, R=80):
    return AgentLoop(MultiTurnSettings(enable=True, max_assistant_turns=2), tok, R,
                     tools=build_tools(calc_tool_specs()))


def rows_of(rows):
    return [{"raw_prompt": r["prompt"], "extra_info": r["extra_info"], "ground_truth": r["ground_truth"]}
            for r in rows]


def test_calculator_in_the_agent_loop_counts_its_errors(tok):
    """A good expression is a success; a refused one the model reads as the tool's message, counted in
    tool_calls/tool_errors (before: counted a success, success_rate 1.0)."""
    rows = [{"prompt": [{"role": "user", "content": q}], "extra_info": {}, "ground_truth": "1"}
            for q in ("37*48=", "os=")]
    expr = {"37*48=": "37*48", "os=": "__import__('os')"}

    def first(text):
        return calc_call_text(next(v for k, v in expr.items() if k in text))

    samples, m = agent(tok, R=200).run(TokenFleet(tok, first, lambda _: "#### 1").generate, rows_of(rows),
                                       SamplingConfig(n=1, max_new_tokens=200))
    texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    assert "tool\n1776\nassistant\n#### 1" in texts[0]
    assert "tool\nError: Call is not allowed (only numbers" in texts[1]
    assert m["tool_calls/mean"] == 1.0 and m["tool_calls/success_rate"] == 0.5
    assert m["tool_calls/tool_errors"] == 1 and m["tool_calls/errors"] == 1 and m["num_turns/mean"] == 4


def test_dataset_is_seeded_and_right():
    a, b = make_calc_dataset(50, seed=3), make_calc_dataset(50, seed=3)
    assert a == b and a != make_calc_dataset(50, seed=4)
    for r in a:
        e = r["extra_info"]
        assert 10 <= e["a"] <= 99 and 10 <= e["b"] <= 99 and r["ground_truth"] == str(e["a"] * e["b"])
        assert r["prompt"] == [{"role": "user", "content": f"{e['a']}*{e['b']}="}]
        assert e["tools_kwargs"] == {"calc": {"create_kwargs": {"ground_truth": r["ground_truth"]}}}


def test_warmup_examples_are_the_agent_loops_trajectories(tok):
    """The supervised examples of tiny://calc are token for token the sequences the agent loop builds (prompt,
    model turn + EOS, the tool message's rendered ids with mask 0, the answer + EOS), for a right call (the tool's
    value) and a wrong tool name (the loop's unknown-tool error)."""
    rows = make_calc_dataset(40, seed=0)
    examples = calc_warmup_examples(tok, rows, answer_noise=0.5, seed=0)
    texts = [tok.decode(p + r, skip_special_tokens=False) for p, r, _ in examples]
    wrong = [i for i, t in enumerate(texts) if '"name": "calc"' not in t]
    assert 8 <= len(wrong) <= 32  # about half
    for i in (wrong[0], next(i for i in range(40) if i not in wrong)):
        p, r, mask = examples[i]
        call = tok.decode(r[:r.index(tok.eos_token_id)])
        k = max(j for j in range(1, len(r)) if mask[j] and not mask[j - 1])  # the answer turn: the last model span
        answer = tok.decode(r[k:-1])
        samples, m = agent(tok).run(TokenFleet(tok, lambda _: call, lambda _: answer).generate, rows_of([rows[i]]),
                                    SamplingConfig(n=1, max_new_tokens=80))
        s = samples[0]
        assert (s.prompt_ids, s.response_ids, s.extra["response_mask"]) == (p, r, mask)
        assert m["tool_calls/success_rate"] == (0.0 if i in wrong else 1.0)
    assert "<tool_call>" in tok.get_vocab() and len(tok("<tool_call>", add_special_tokens=False)["input_ids"]) == 1


def test_bad_calls_are_logged_once_not_per_call(tok, caplog):
    """Calls of an unknown tool: counted each, logged once by the loop; SGLang's per-call log lines ("Model
    attempted to call undefined function", every call) are dropped."""
    import logging

    rows = make_calc_dataset(3, seed=0)
    with caplog.at_level(logging.INFO):
        _, m = agent(tok).run(TokenFleet(tok, lambda t: calc_call_text("1*2", "multiply"),
                                         lambda _: "#### 2").generate, rows_of(rows),
                              SamplingConfig(n=2, max_new_tokens=80))
    assert m["tool_calls/unknown_tool"] == 6 and m["tool_calls/success_rate"] == 0.0
    assert not [r for r in caplog.records if r.name.startswith("sglang")], caplog.text
    assert [r.name for r in caplog.records if "tool_calls/unknown_tool" in r.getMessage()] == ["rlhf.agent.loop"]


def test_tiny_calc_builds_in_its_own_directory(tmp_path):
    """tiny://calc: the quickstart build with the calc task and its tokenizer (hermes' markers one token each,
    kept by decoding), cached apart from tiny://quickstart; hf_source finds it for a run's checkpoints."""
    import json

    from transformers import AutoTokenizer

    from rlhf.quickstart.model import built_quickstart_model, resolve_model_path
    from rlhf.trainer.hf_source import _local_model_dir

    out = resolve_model_path("tiny://calc", tmp_path / "tiny_model", warmup_steps=2, max_operand=99)
    assert out == str(tmp_path / "tiny_model" / "tiny_calc_model")
    meta = json.loads((tmp_path / "tiny_model" / "tiny_calc_model" / "warmup_meta.json").read_text())
    assert meta["task"] == {"style": "calc", "ops": ["*"], "min_operand": 10, "max_operand": 99}
    assert meta["vocab_size"] == 480 and meta["warmup_steps"] == 2
    assert built_quickstart_model(tmp_path / "tiny_model", calc=True, warmup_steps=2, max_operand=99) == out
    assert built_quickstart_model(tmp_path / "tiny_model", warmup_steps=2, max_operand=99) is None
    assert _local_model_dir("tiny://calc", str(tmp_path)) == out
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(calc_call_text("37*48"), add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>") and ids[-1] == tok.convert_tokens_to_ids("</tool_call>")
    assert tok.decode(ids, skip_special_tokens=True) == calc_call_text("37*48")
