"""The quickstart tokenizer and the encoding of its supervised examples."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple, Union

__all__ = ["QUICKSTART_VOCAB_SIZE", "make_quickstart_tokenizer", "prompt_ids", "encode_example"]

QUICKSTART_VOCAB_SIZE = 400


def _task_corpus() -> List[str]:
    """Sentences covering every word of the embedded task (both styles), so BPE merges them."""
    from .arithmetic import ITEMS, NAMES, make_arithmetic_problem

    out = []
    for i, name in enumerate(NAMES):
        for j, item in enumerate(ITEMS):
            a, b = 2 + (i + j) % 7, 1 + (i * 3 + j) % 5
            op = "+-*"[(i + j) % 3]
            q, sol, _ = make_arithmetic_problem(a, b, op, style="word", name=name, item=item)
            out += [q, sol, f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{sol}<|im_end|>"]
    return out


def make_quickstart_tokenizer(vocab_size: int = QUICKSTART_VOCAB_SIZE, calc: bool = False):
    """The quickstart tokenizer: :func:`rlhf.quickstart.tiny.make_tiny_tokenizer` (ChatML
    template, EOS ``<|im_end|>``, pad ``<|pad|>``) trained on the default corpus plus the
    embedded task's sentences.  ``calc`` (``tiny://calc``): also on the calculator task's calls and tool
    messages (rlhf.quickstart.calc), with hermes' ``<tool_call>`` / ``</tool_call>`` added as tokens (not
    special: decoding keeps them, as Qwen2.5's tokenizer does)."""
    from .tiny import DEFAULT_CORPUS, make_tiny_tokenizer

    if not calc:
        return make_tiny_tokenizer(vocab_size=vocab_size, corpus=list(DEFAULT_CORPUS) + _task_corpus())
    from .calc import TOOL_CALL_TOKENS, calc_corpus

    tok = make_tiny_tokenizer(vocab_size=vocab_size, corpus=list(DEFAULT_CORPUS) + _task_corpus() + calc_corpus())
    tok.add_tokens(list(TOOL_CALL_TOKENS))
    return tok


def prompt_ids(tokenizer: Any, prompt: Union[str, List[Dict[str, str]]]) -> List[int]:
    """Prompt token ids exactly as RLHFDataset produces them (chat template if the tokenizer has one)."""
    from rlhf.data.prompts import render_prompt

    use_chat = bool(getattr(tokenizer, "chat_template", None))
    text = render_prompt(tokenizer, prompt, use_chat)
    return list(tokenizer(text, add_special_tokens=not use_chat)["input_ids"])


def encode_example(tokenizer: Any, prompt: Union[str, List[Dict[str, str]]],
                   solution: str) -> Tuple[List[int], List[int]]:
    """``(prompt_ids, response_ids)`` for one supervised example; the response is the
    solution followed by the tokenizer's EOS token, so generation learns to stop."""
    p = prompt_ids(tokenizer, prompt)
    r = list(tokenizer(solution, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        r.append(int(tokenizer.eos_token_id))
    return p, r
