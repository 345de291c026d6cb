"""Evaluate a (quickstart) HF model on arithmetic / GSM8K rows: reward, answer format, EOS rate."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from rlhf.data.collate import pad_sequences

from .tokenizer import prompt_ids

__all__ = ["evaluate_model"]


@torch.no_grad()
def evaluate_model(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Dict[str, Any]],
    *,
    temperature: float = 0.0,
    num_samples: int = 1,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    seed: int = 0,
) -> Dict[str, float]:
    """Generate with HF ``generate`` and score with the rule reward of each row's ``data_source`` (the strict
    GSM8K scorer for the arithmetic task; the MATH reward, math-verify, for the boxed style).

    Returns ``{"reward": mean score, "format": fraction with a ``#### N`` (boxed style: ``\\boxed{N}``) answer,
    "eos": fraction that stopped with EOS}`` over ``len(rows) * num_samples`` responses
    (greedy when ``temperature == 0``). Sampling is seeded by ``seed``; the caller's RNG
    state is restored afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _evaluate(model, tokenizer, rows, temperature, num_samples, max_new_tokens, batch_size)


def _evaluate(model, tokenizer, rows, temperature, num_samples, max_new_tokens, batch_size) -> Dict[str, float]:
    from rlhf.rewards.gsm8k import extract_solution
    from rlhf.rewards.math_answers import MATH_DATA_SOURCES, extract_boxed_answer
    from rlhf.rewards.registry import call_reward_fn, get_reward_fn

    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    scores, fmt, stopped = [], [], []
    items = [r for r in rows for _ in range(num_samples)]
    for s in range(0, len(items), batch_size):
        chunk = items[s:s + batch_size]
        ids, mask = pad_sequences([prompt_ids(tokenizer, r["prompt"]) for r in chunk], pad, side="left")
        L = ids.shape[1]
        if temperature > 0:
            gen_kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:
            gen_kw = dict(do_sample=False)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=pad, **gen_kw)[:, L:]
        for b, r in enumerate(chunk):
            toks = out[b].tolist()
            stop = eos in toks
            if stop:
                toks = toks[:toks.index(eos)]
            text = tokenizer.decode(toks, skip_special_tokens=True)
            ds = r["data_source"]
            scores.append(float(call_reward_fn(get_reward_fn(ds), data_source=ds, solution_str=text,
                                               ground_truth=r["ground_truth"])))
            fmt.append((extract_boxed_answer if ds in MATH_DATA_SOURCES else extract_solution)(text) is not None)
            stopped.append(stop)
    n = max(1, len(scores))
    return {"reward": sum(scores) / n, "format": sum(fmt) / n, "eos": sum(stopped) / n}
