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


#: Without autograd, log-probs are computed on slices of the leading dim holding at most this many logits (128 MiB
#: of float32), so the temporaries (the shifted logits and their exp, 2-4 copies of the logits) cover one slice, not
#: the whole micro batch: old/reference log-probs of 64 sequences x 100 tokens x a 32k vocabulary held 3 x 820 MB.
#: Row-wise math: the values are the same as in one piece; every TP rank slices the same shape (same collectives).
NO_GRAD_CHUNK_ELEMENTS = 1 << 25


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                             vocab_start: int = 0, temperature: float = 1.0, tp_group=None,
                             calculate_entropy: bool = False):
    """log p(labels) and optionally the entropy of softmax(logits / temperature).

    Without autograd (``torch.is_grad_enabled()`` False) and above :data:`NO_GRAD_CHUNK_ELEMENTS` logits, in slices
    of the leading dim (same values, bounded temporaries).

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
    kw = dict(vocab_size=vocab_size, vocab_start=vocab_start, temperature=temperature, tp_group=tp_group,
              calculate_entropy=calculate_entropy)
    if not torch.is_grad_enabled() and logits.dim() > 1 and logits.numel() > NO_GRAD_CHUNK_ELEMENTS:
        rows = max(1, NO_GRAD_CHUNK_ELEMENTS * logits.shape[0] // logits.numel())
        if rows < logits.shape[0]:
            parts = [_log_probs(logits[i:i + rows], labels[i:i + rows], **kw)
                     for i in range(0, logits.shape[0], rows)]
            return (torch.cat([p[0] for p in parts]),
                    torch.cat([p[1] for p in parts]) if calculate_entropy else None)
    return _log_probs(logits, labels, **kw)


def _log_probs(logits, labels, *, vocab_size, vocab_start, temperature, tp_group, calculate_entropy):
    """:func:`vocab_parallel_log_probs` on one piece (arguments checked)."""
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
