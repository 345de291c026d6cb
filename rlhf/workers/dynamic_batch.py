"""Dynamic batching (verl's ``use_dynamic_bsz``): micro batches cut by a token budget instead of a row count,
rows of similar length grouped together, and each micro batch stripped of its padding.

Why not megatron-core's packed sequences (THD, ``PackedSeqParams``)?  They need Transformer Engine's fused
attention: megatron's local layer spec (CPU, or any machine without TE) asserts ``packed_seq_params is None``
in ``DotProductAttention``, and parallel.forward feeds [b, s] rows.  The fallback used on every backend
is **compacted padded rows**: a micro batch's rows are left-aligned (prompt tokens, then response tokens,
then padding) and cut to the micro batch's longest real sequence, so the padding processed is only the
difference between rows of one micro batch; sorting rows by length before cutting keeps that difference
small.  Each such micro batch is counted in ``perf/packing_fallback_micro_batches``.

Layout (rlhf.workers.batch): a batch row has its real tokens in ONE contiguous span [P - p_i, P + r_i) of
its P + R columns (left-padded prompt, right-padded response).  :func:`compact_rows` moves that span to
columns [0, p_i + r_i) of an [b, L] micro batch, L = max_i(p_i + r_i); :func:`expand_rows` scatters
[b, L] outputs back to the [b, P + R] layout, with 0 on padding, exactly where the padded path puts them.
Causal attention makes a real token's output independent of the padding after it, so the outputs equal
the padded path's (to float rounding).

Padding efficiency (``perf/padding_efficiency``) = real tokens / tokens the model processed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .batch import MODEL_KEYS

__all__ = ["partition_by_token_budget", "compact_rows", "expand_rows", "PaddingCounter", "check_token_budget",
           "micro_batch_cost", "token_budgets"]


def micro_batch_cost(lengths: Sequence[int]) -> int:
    """Tokens a compacted micro batch of rows with these real lengths processes: rows x the longest."""
    return len(lengths) * max(lengths) if len(lengths) else 0


def partition_by_token_budget(lengths: Sequence[int], max_tokens: int, group: int = 1) -> list[list[int]]:
    """Row indices of the micro batches of one data-parallel rank's rows, by token budget.

    Args:
        lengths: real tokens (prompt + response) of each row, [n] ints.
        max_tokens: the budget: a micro batch processes at most this many tokens, counted as
            rows x its longest row (what a compacted micro batch costs, :func:`micro_batch_cost`).
        group: rows that must share a micro batch (2: a DPO pair), consecutive in `lengths`.
    Returns:
        Lists of row indices covering every row once.  Rows are sorted by length (longest first) and cut
        into the fewest consecutive groups within the budget; among cuts with that count, the one whose
        largest micro batch is cheapest (balanced micro batches, verl's "rearrange by seqlen" with the
        padded cost).  Deterministic: every pipeline stage of a data-parallel rank gets the same cut.
    Raises:
        ValueError when `n` is not a multiple of `group` or a row (group) alone exceeds the budget.
    """
    n = len(lengths)
    if n % group:
        raise ValueError(f"{n} rows do not split into groups of {group}")
    units = [max(int(x) for x in lengths[i:i + group]) for i in range(0, n, group)]
    longest = max(units)
    if group * longest > max_tokens:
        raise ValueError(f"a micro batch needs at least {group * longest} tokens ({group} row(s) of {longest} "
                         f"prompt + response tokens) but the token budget is {max_tokens}; raise "
                         f"*.ppo_max_token_len_per_gpu / *.log_prob_max_token_len_per_gpu to at least "
                         f"{group} x (data.max_prompt_length + data.max_response_length)")
    order = sorted(range(len(units)), key=lambda u: (-units[u], u))

    def cut(cap: int) -> list[list[int]]:
        parts, cur = [], []
        for u in order:
            if cur and (len(cur) + 1) * group * units[cur[0]] > cap:
                parts.append(cur)
                cur = []
            cur.append(u)
        return parts + [cur]

    best = cut(max_tokens)
    lo, hi = group * longest, max_tokens  # smallest cap giving as few micro batches as the budget allows
    while lo < hi:
        mid = (lo + hi) // 2
        if len(cut(mid)) <= len(best):
            hi = mid
        else:
            lo = mid + 1
    return [[u * group + j for u in sorted(part) for j in range(group)] for part in cut(lo)]


def compact_rows(rows: dict) -> tuple[dict, torch.Tensor]:
    """Left-align a micro batch's rows and cut them to the longest real sequence.

    Args:
        rows: MODEL_KEYS tensors [b, S] in the batch layout (one contiguous real span per row), optionally
            ``routed_experts`` [b, S, layers, k] (compacted like them), and any other [b, ...] tensors, which are kept
            as they are.
    Returns:
        (micro batch with MODEL_KEYS [b, L], L = the longest row's real tokens; other keys unchanged,
        index [b, L] int64: the [b, S] column of each compact column, S for padding (see :func:`expand_rows`)).
    """
    mask = rows["attention_mask"].bool()
    S = mask.shape[1]
    L = int(mask.sum(1).max())
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :L]  # real columns first, in order
    out = dict(rows)
    for k in MODEL_KEYS:
        out[k] = rows[k].gather(1, order)
    if rows.get("routed_experts") is not None:  # MoE routing replay: [b, S, layers, k], compacted the same way
        r = rows["routed_experts"]
        out["routed_experts"] = r.gather(1, order.view(*order.shape, 1, 1).expand(-1, -1, *r.shape[2:]))
    valid = out["attention_mask"].bool()
    index = torch.where(valid, order, torch.full_like(order, S))
    return out, index


def expand_rows(t: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """Token outputs [b, L] of a compacted micro batch -> [b, width] in the batch layout (0 on padding);
    differentiable.  `index` from :func:`compact_rows`, `width` = S (P + R)."""
    b, L = index.shape
    full = t[:, :L].new_zeros(b, width + 1)
    return full.scatter(1, index.to(t.device), t[:, :L])[:, :width]


def expand_routing(t: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """Routing [b, L, layers, k] of a compacted micro batch -> [b, width, layers, k] in the batch layout, experts
    0..k-1 on padding (parallel.router_replay.filler: a valid routing no log-prob uses)."""
    from parallel.router_replay import filler

    b, L = index.shape
    full = filler((b, width + 1, t.shape[2]), t.shape[3], t.device).to(t.dtype)
    idx = index.to(t.device).view(b, L, 1, 1).expand(-1, -1, *t.shape[2:])
    return full.scatter(1, idx, t[:, :L])[:, :width]


def check_token_budget(what: str, max_tokens: int | None, max_prompt_length: int, max_response_length: int) -> None:
    """Refuse, before any model is built, a token budget no sequence of the configured lengths is sure to fit:
    ValueError naming `what` (the config key) and the smallest value that works (the message of
    rlhf.config.validate.token_budget_problem, which reports it at ``--cfg`` too)."""
    from rlhf.config.validate import token_budget_problem

    problem = token_budget_problem(what, max_tokens, max_prompt_length, max_response_length)
    if problem:
        raise ValueError(problem)


@dataclass
class PaddingCounter:
    """Real and processed tokens of a worker's model passes since the last :meth:`take`, and the micro
    batches run on the compacted-rows fallback (module docstring)."""

    real: int = 0
    processed: int = 0
    fallback_micro_batches: int = 0

    def add(self, attention_mask: torch.Tensor, processed: int, fallback: bool = False) -> None:
        """Count a micro batch (or a padded call): its real tokens and `processed` (rows x columns run)."""
        self.real += int(attention_mask.sum())
        self.processed += int(processed)
        self.fallback_micro_batches += int(fallback)

    def take(self) -> tuple[int, int, int]:
        """(real, processed, fallback micro batches) since the last take; resets them."""
        out = (self.real, self.processed, self.fallback_micro_batches)
        self.real = self.processed = self.fallback_micro_batches = 0
        return out


def token_budgets(cfg, forward_key: str) -> tuple[int | None, int | None]:
    """(forward budget, update budget) in tokens per micro batch of a role's config section `cfg` (``actor`` or
    ``critic``) when its ``use_dynamic_bsz`` is on, else (None, None): the update's is
    ``ppo_max_token_len_per_gpu``, the no-grad forward's is `forward_key` (``log_prob_max_token_len_per_gpu`` /
    ``forward_max_token_len_per_gpu``), null meaning the update's.  Config sections without these keys (older
    configs, test doubles) run fixed-size micro batches."""
    if not getattr(cfg, "use_dynamic_bsz", False):
        return None, None
    update = cfg.ppo_max_token_len_per_gpu
    return getattr(cfg, forward_key, None) or update, update
