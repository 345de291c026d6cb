"""Context parallelism (CP): each rank of a CP group holds 1/cp of every sequence.

megatron-core runs CP inside Transformer Engine's attention only (its local `DotProductAttention`
asserts ``context_parallel_size == 1``), so CP is a GPU path; everything here is device-independent
and runs on CPU with gloo groups in the tests.

Layout (megatron's, from `megatron.core.utils.get_batch_on_this_cp_rank`): a sequence of S tokens is
cut into 2*cp equal chunks and CP rank r holds chunks r and 2*cp-1-r, so every rank gets the same
share of causal-attention work.  megatron's rotary embedding (`get_pos_emb_on_this_cp_rank`) and TE's
ring attention assume exactly this split, so the batch is split with megatron's own function.

Outputs (per-token log-probs, entropy, values) are computed on the local tokens and gathered back to
the full sequence with `gather_from_context_parallel`, whose backward hands each rank the gradient of
its own tokens only.  Every CP rank then evaluates the same loss on the same full tensors; megatron's
schedule multiplies a (loss, metrics) loss by cp (`forward_step` in pipeline_parallel/schedules.py)
and its DDP averages gradients over the dp x cp ranks, so the summed gradient is the unsplit one.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def seq_length_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple the sequence length S must have: 2*cp chunks, each rank's S/cp a multiple of tp
    under sequence parallelism.  Returns 1 for cp = 1 without SP."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp={cp}, tp={tp}: both must be >= 1")
    multiple = 2 * cp if cp > 1 else 1
    if sequence_parallel and tp > 1:
        multiple = multiple * (cp * tp) // math.gcd(multiple, cp * tp)
    return multiple


def local_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Indices [S/cp] (int64) of the full sequence that CP rank `cp_rank` holds, in its order.

    Raises ValueError when S is not a multiple of 2*cp or the rank is out of range.
    """
    if cp == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 * context_parallel_size = {2 * cp}; "
                         f"pad it (parallel.context_parallel.seq_length_multiple)")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is not in [0, {cp})")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def split_for_context_parallel(tensors: dict, cp_group=None) -> dict:
    """This CP rank's part of every [b, S, ...] tensor in `tensors` (megatron's
    `get_batch_on_this_cp_rank`; values that are None stay None).  `cp_group` None: megatron's
    parallel_state CP group.  A copy of the dict; the tensors are views / index_selects."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(tensors), cp_group=cp_group)


class _GatherFromContextParallel(torch.autograd.Function):
    """[b, S/cp, ...] local tokens -> [b, S, ...] full sequence; backward: this rank's tokens' gradient."""

    @staticmethod
    def forward(ctx, x, group, cp, cp_rank):
        ctx.cp, ctx.cp_rank = cp, cp_rank
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        b, s_local = x.shape[:2]
        chunk = s_local // 2
        full = x.new_empty((b, s_local * cp, *x.shape[2:]))
        for r, part in enumerate(parts):
            full[:, r * chunk:(r + 1) * chunk] = part[:, :chunk]
            full[:, (2 * cp - 1 - r) * chunk:(2 * cp - r) * chunk] = part[:, chunk:]
        return full

    @staticmethod
    def backward(ctx, grad):
        idx = local_positions(grad.shape[1], ctx.cp, ctx.cp_rank, device=grad.device)
        return grad.index_select(1, idx), None, None, None


def gather_from_context_parallel(x: torch.Tensor, cp_group=None) -> torch.Tensor:
    """Reassemble the full sequence from every CP rank's local tokens.

    Args:
        x: [b, S/cp, ...] this rank's tokens in megatron's CP order (chunks r and 2*cp-1-r); on the
            CP group's device (NCCL: cuda).
        cp_group: the CP process group (None: megatron parallel_state's).
    Returns:
        [b, S, ...] in sequence order, identical on every CP rank.  Differentiable: the gradient that
        reaches `x` is the full gradient's entries at this rank's positions (no sum over ranks, since
        every CP rank computes the same loss from the same full tensor).
    Raises:
        ValueError when S/cp is odd (not two equal chunks).
    """
    from megatron.core import parallel_state as ps

    if cp_group is None:
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        cp_group = ps.get_context_parallel_group() if cp > 1 else None
    else:
        cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if cp == 1:
        return x
    if x.shape[1] % 2:
        raise ValueError(f"local sequence length {x.shape[1]} is odd: a CP rank holds two equal chunks")
    return _GatherFromContextParallel.apply(x, cp_group, cp, cp_rank)
