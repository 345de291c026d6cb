"""``embedded://calc`` and ``tiny://calc``: two-digit multiplication that the tiny model can only answer with a
calculator tool (rlhf.agent.calculator), in the hermes tool-call format of SGLang's FunctionCallParser.

The task: prompt ``"37*48="`` (operands uniform in ``[min_operand, max_operand]``, default 10..99; seeded), ground
truth ``"1776"``, scored by the strict GSM8K rule on ``#### N`` (``data_source="synthetic/arithmetic"``).  A model of
125k parameters cannot multiply two-digit numbers, but it can copy: the intended trajectory is

    assistant: <tool_call>\\n{"name": "calc", "arguments": {"expression": "37*48"}}\\n</tool_call><|im_end|>
    tool:      1776
    assistant: #### 1776<|im_end|>

The warm-up (``build_quickstart_model(..., task=CALC_TASK)``) is supervised on such trajectories laid out token by
token as the agent loop lays them out (the prompt, the model turn and its EOS, the tool message's ids from the chat
template's incremental rendering (rlhf.agent.render), the next model turn), with the loss on the model's tokens
only.  Partial competence, as in the quickstart (rlhf.quickstart.model): in a fraction ``answer_noise`` of the
demonstrations the call names a tool that does not exist (``calculator``, ``compute``, ``multiply``); the agent
loop answers that with its unknown-tool error and the demonstration then guesses a number.  RL has to learn that
only ``calc`` gets an answer, which raises ``tool_calls/success_rate`` and the score together.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, Union

from .arithmetic import DATA_SOURCE, _write_splits

__all__ = ["CALC_TASK", "CALC_BUILD", "CALC_MAX_OPERAND", "CALC_TOOL_NAME", "CALC_TOOL_SCHEMA", "WRONG_TOOL_NAMES",
           "TOOL_CALL_TOKENS", "calc_call_text", "make_calc_dataset", "write_calc_parquet", "calc_corpus",
           "calc_warmup_examples", "calc_tool_specs"]

#: the warm-up task of ``tiny://calc`` (``task`` of build_quickstart_model; ``max_operand``: data.embedded_max_operand)
CALC_TASK: Dict[str, Any] = {"style": "calc", "ops": ("*",), "min_operand": 10}
CALC_MAX_OPERAND = 99
#: what ``tiny://calc`` passes to build_quickstart_model besides the config's warm-up settings: a larger BPE
#: vocabulary (the calls' JSON and the tool's error message merge into fewer tokens)
CALC_BUILD: Dict[str, Any] = {"task": CALC_TASK, "vocab_size": 480}
CALC_TOOL_NAME = "calc"
#: the OpenAI function schema of the calculator (as in recipes/calc_tool_tiny_cpu/tool_config/calc_tool_config.yaml)
CALC_TOOL_SCHEMA: Dict[str, Any] = {
    "type": "function",
    "function": {"name": CALC_TOOL_NAME,
                 "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                 "parameters": {"type": "object",
                                "properties": {"expression": {"type": "string",
                                                              "description": "the expression, e.g. 37*48"}},
                                "required": ["expression"]}}}
WRONG_TOOL_NAMES = ("calculator", "compute", "multiply")
#: hermes' call markers, added to the tiny tokenizer as (non-special) tokens, as Qwen2.5's tokenizer has them
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
_GUESS_SEED_OFFSET = 104_729


def calc_call_text(expression: str, name: str = CALC_TOOL_NAME) -> str:
    """One hermes tool call (SGLang's HermesDetector format) of ``name`` with ``{"expression": expression}``."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def make_calc_dataset(n: int, seed: int = 0, max_operand: int = CALC_MAX_OPERAND, min_operand: int = 10,
                      ops: Sequence[str] = ("*",), split: str = "train", **_: Any) -> List[Dict[str, Any]]:
    """``n`` problems ``"a*b="`` seeded by ``seed``: rows with ``data_source`` ("synthetic/arithmetic"), ``prompt``
    (chat messages), ``ground_truth`` (str), ``ability``, ``extra_info`` ({split, index, a, b, op, tools_kwargs:
    verl's ``{calc: {create_kwargs: {ground_truth}}}``}).

    Raises:
        ValueError: ``n < 0`` or a bad operand range / op (``+``, ``-`` or ``*``).
    """
    if n < 0 or not 0 <= min_operand <= max_operand or not ops or any(o not in "+-*" for o in ops):
        raise ValueError(f"make_calc_dataset: n={n}, operands [{min_operand}, {max_operand}], ops={ops!r}: need "
                         f"n >= 0, 0 <= min_operand <= max_operand and ops among + - *.")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        op = rng.choice(tuple(ops))
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        ans = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                     "ground_truth": str(ans), "ability": "math",
                     "extra_info": {"split": split, "index": i, "a": a, "b": b, "op": op,
                                    "tools_kwargs": {CALC_TOOL_NAME: {"create_kwargs": {"ground_truth": str(ans)}}}}})
    return rows


def write_calc_parquet(out_dir: Union[str, Path], n_train: int, n_test: int, seed: int = 0,
                       **kwargs: Any) -> Dict[str, Path]:
    """``out_dir/train.parquet`` and ``test.parquet`` (seed + 1) of :func:`make_calc_dataset` (``kwargs``)."""
    return _write_splits(out_dir, n_train, n_test, seed,
                         lambda n, s, split: make_calc_dataset(n, seed=s, split=split, **kwargs))


def calc_tool_specs():
    """The calculator as the agent loop's tool spec list (``rlhf.agent.config.ToolSpec``)."""
    from rlhf.agent.config import ToolSpec

    return [ToolSpec("rlhf.agent.calculator.CalculatorTool", {}, CALC_TOOL_SCHEMA)]


def calc_corpus() -> List[str]:
    """Texts with the calls, tool messages and answers of the task, so the tiny BPE merges their words."""
    out = []
    for i in range(30):
        a, b = 10 + (7 * i) % 90, 99 - (11 * i) % 90
        for name in (CALC_TOOL_NAME,) + WRONG_TOOL_NAMES:
            out.append(calc_call_text(f"{a}*{b}", name))
        out += [f"{a}*{b}=", f"#### {a * b}", _unknown_tool_message(WRONG_TOOL_NAMES[i % len(WRONG_TOOL_NAMES)])]
    return out


def _unknown_tool_message(name: str) -> str:
    # what rlhf.agent.parsing / loop answer a call of an unknown tool (checked by the unit test of this module)
    return f"Error when executing tool: unknown tool {name!r} (available: {CALC_TOOL_NAME})"


def calc_warmup_examples(tokenizer: Any, rows: Sequence[Dict[str, Any]], answer_noise: float,
                         seed: int) -> List[Tuple[List[int], List[int], List[int]]]:
    """Supervised multi-turn examples ``(prompt_ids, response_ids, loss_mask)`` of ``rows`` (make_calc_dataset),
    laid out as rlhf.agent.loop lays out a trajectory: model turn + EOS (mask 1), the tool message's ids from
    :class:`rlhf.agent.render.ChatRenderer` (mask 0), the answer turn + EOS (mask 1).  A fraction ``answer_noise``
    (seeded by ``seed``) calls a wrong tool name, reads the loop's unknown-tool error and guesses a wrong number."""
    from rlhf.agent.render import ChatRenderer

    from .tokenizer import prompt_ids

    renderer = ChatRenderer(tokenizer, [CALC_TOOL_SCHEMA])
    rng = random.Random(seed + _GUESS_SEED_OFFSET)
    eos = int(tokenizer.eos_token_id)
    out = []
    for r in rows:
        e = r["extra_info"]
        expr, truth = f"{e['a']}{e['op']}{e['b']}", int(r["ground_truth"])
        if rng.random() < answer_noise:
            name = rng.choice(WRONG_TOOL_NAMES)
            tool_text = _unknown_tool_message(name)
            answer = rng.randint(10, 9999)  # a guess unrelated to the operands: only the tool's answer helps
        else:
            name, tool_text, answer = CALC_TOOL_NAME, str(truth), truth
        call, final = calc_call_text(expr, name), f"#### {answer}"
        p = prompt_ids(tokenizer, r["prompt"])
        call_ids = list(tokenizer(call, add_special_tokens=False)["input_ids"]) + [eos]
        history = list(r["prompt"]) + [{"role": "assistant", "content": call}]
        tool_ids = renderer.delta(history, [{"role": "tool", "content": tool_text}])
        final_ids = list(tokenizer(final, add_special_tokens=False)["input_ids"]) + [eos]
        out.append((p, call_ids + tool_ids + final_ids, [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(final_ids)))
    return out
