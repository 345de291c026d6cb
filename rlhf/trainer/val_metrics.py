"""Validation metrics per data source, pass@k, and the table of sample generations.

    val/score                      mean score over every validation response
    val/<data_source>/score        mean score of that data source's responses
    val/<data_source>/pass@k       (rollout.val_kwargs.n > 1) unbiased pass@k, k = 1, 2, 4, ... and n
    val/<data_source>/best@n       (n > 1) mean over prompts of the best of their n scores
    val/generations                Table (data_source, prompt, response, score) of the first
                                   trainer.log_val_generations responses (the same prompts every validation)

and verl's names (verl/trainer/ppo/metric_utils.py process_validation_metrics, grouped as in ray_trainer.py
_val_metrics_update), per data source over the prompts answered N times:

    val-core/<data_source>/reward/mean@N   mean over prompts of the mean of their N scores (N: the most
                                           responses a prompt of that source got; smaller N under val-aux/)
    val-aux/<data_source>/reward/std@N     (N > 1) mean over prompts of the population std of their N scores

A response counts as correct for pass@k when its score is at least :data:`CORRECT_SCORE` (the rule rewards
score 1.0 for a correct answer, rlhf.rewards).
"""
from __future__ import annotations

from collections import defaultdict
from math import comb
from typing import Any, Hashable, Sequence

from .tracking import Table

__all__ = ["pass_at_k", "pass_at_k_values", "validation_metrics", "verl_validation_metrics", "generations_table",
           "CORRECT_SCORE", "GENERATION_COLUMNS"]

CORRECT_SCORE = 1.0
GENERATION_COLUMNS = ("data_source", "prompt", "response", "score")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k responses drawn without replacement from n, c of them correct, is
    correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    eq. 1).

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_k_values(n: int) -> list[int]:
    """The k reported for n responses per prompt: the powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def validation_metrics(data_sources: Sequence[str], prompt_ids: Sequence[Hashable], scores: Sequence[float],
                       n: int) -> dict:
    """The ``val/*``, ``val-core/*`` and ``val-aux/*`` scalars (module docstring) of M responses:
    `data_sources` [M], `prompt_ids` [M] (the responses of one prompt share an id), `scores` [M]; `n` responses
    per prompt (``rollout.val_kwargs.n``).
    Prompts with fewer than n responses use their own count.  Empty input gives ``{"val/score": 0.0}``."""
    if not scores:
        return {"val/score": 0.0}
    out = {"val/score": sum(scores) / len(scores)}
    by_source: dict[str, list[float]] = defaultdict(list)
    groups: dict[str, dict[Hashable, list[float]]] = defaultdict(lambda: defaultdict(list))
    for ds, pid, s in zip(data_sources, prompt_ids, scores):
        by_source[ds].append(float(s))
        groups[ds][pid].append(float(s))
    out.update(verl_validation_metrics(groups))
    for ds, values in sorted(by_source.items()):
        out[f"val/{ds}/score"] = sum(values) / len(values)
        if n <= 1:
            continue
        prompts = list(groups[ds].values())
        for k in pass_at_k_values(n):
            est = [pass_at_k(len(g), sum(s >= CORRECT_SCORE for s in g), min(k, len(g))) for g in prompts]
            out[f"val/{ds}/pass@{k}"] = sum(est) / len(est)
        out[f"val/{ds}/best@{n}"] = sum(max(g) for g in prompts) / len(prompts)
    return out


def verl_validation_metrics(groups: dict[str, dict[Hashable, list[float]]]) -> dict:
    """verl's ``val-core/<ds>/reward/mean@N`` and ``val-aux/<ds>/reward/{mean,std}@N`` (module docstring) of
    `groups`: data source -> prompt id -> that prompt's scores.  verl's bootstrapped best@N / worst@N are left
    out (val/<ds>/best@n is the exact mean of the best scores)."""
    out = {}
    for ds, prompts in sorted(groups.items()):
        per_name: dict[str, list[float]] = defaultdict(list)
        for g in prompts.values():
            n, mean = len(g), sum(g) / len(g)
            per_name[f"mean@{n}"].append(mean)
            if n > 1:
                per_name[f"std@{n}"].append((sum((x - mean) ** 2 for x in g) / n) ** 0.5)
        n_max = max(len(g) for g in prompts.values())
        for name, values in per_name.items():
            sec = "val-core" if name == f"mean@{n_max}" else "val-aux"
            out[f"{sec}/{ds}/reward/{name}"] = sum(values) / len(values)
    return out


def generations_table(rows: Sequence[Sequence[Any]]) -> Table:
    """A :class:`Table` of (data_source, prompt, response, score) rows."""
    return Table(list(GENERATION_COLUMNS), [list(r) for r in rows])
