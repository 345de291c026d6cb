"""Per-token log-probabilities and entropy from vocab-parallel logits.

Each TP rank holds logits for its slice of the (padded) vocabulary, [b, s, V_pad / tp].  We never
gather the full vocabulary: the max, the partition function and the target logit are reduced
across the TP group (3 all-reduces of [b, s] tensors).  Padded vocabulary rows (ids >= the real
vocab size) are excluded (-inf).  Logits are divided by `temperature` first, as SGLang does before
its sampler and its returned log-probs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceMax(torch.autograd.Function):
    """Max over the TP group; no gradient (used only as a stabiliser)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group in forward; identity in backward (the downstream computation is
    replicated on every TP rank, so each rank's partial receives the same gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                             vocab_start: int = 0, temperature: float = 1.0, tp_group=None,
                             calculate_entropy: bool = False):
    """log p(labels) and optionally the entropy of softmax(logits / temperature).

    Args:
        logits: [..., V_local] float logits of this rank's vocab slice, which starts at global id
            `vocab_start` (rank * V_local). Not modified.
        labels: [...] int64 global token ids (< vocab_size).
        vocab_size: the real (unpadded) vocabulary size; ids >= vocab_size are masked out.
        temperature: > 0; logits are divided by it (SGLang's convention).
        tp_group: process group over which the vocab is split (None: no split).
    Returns:
        (log_probs [...], entropy [...] or None), float32, differentiable w.r.t. logits.
    Raises:
        ValueError for temperature <= 0 or a shape mismatch.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy decoding uses temperature 1 "
                         f"for log-probs)")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on leading dims")
    v_local = logits.shape[-1]
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    ids = torch.arange(vocab_start, vocab_start + v_local, device=z.device)
    valid = ids < vocab_size
    if not bool(valid.all()):
        z = z.masked_fill(~valid, float("-inf"))
    z_max = _AllReduceMax.apply(z.detach().max(dim=-1).values, tp_group)
    z_max = torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max))
    shifted = z - z_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _AllReduceSum.apply(exp.sum(-1), tp_group)
    log_z = sum_exp.log()
    local_label = labels - vocab_start
    in_range = (local_label >= 0) & (local_label < v_local)
    gathered = shifted.gather(-1, local_label.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target = _AllReduceSum.apply(torch.where(in_range, gathered, torch.zeros_like(gathered)), tp_group)
    log_probs = target - log_z
    entropy = None
    if calculate_entropy:
        # H = log Z - sum_v p_v z_v = log Z - (sum_v e^{z_v} z_v) / Z.  Both sums are all-reduced
        # BEFORE they are combined, so everything downstream of a reduction is replicated on every
        # TP rank and the identity backward of _AllReduceSum is exact (dividing a per-rank partial by
        # the global Z first would leave each rank with only its share of dH/dZ).
        # Padded (-inf) logits are zeroed BEFORE multiplying: 0 * -inf would back-propagate NaN.
        finite = torch.where(valid, shifted, torch.zeros_like(shifted))
        weighted = _AllReduceSum.apply((exp * finite).sum(-1), tp_group)
        entropy = log_z - weighted / sum_exp
    return log_probs, entropy


def log_probs_from_megatron_logits(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                   temperature: float = 1.0, calculate_entropy: bool = False):
    """`vocab_parallel_log_probs` with the TP group and vocab offset from megatron parallel_state.

    logits: [b, s, V_pad / tp] (GPTModel output with parallel_output=True); labels [b, s].
    """
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    return vocab_parallel_log_probs(logits, labels, vocab_size=vocab_size, vocab_start=tp_rank * logits.shape[-1],
                                    temperature=temperature, tp_group=group, calculate_entropy=calculate_entropy)
