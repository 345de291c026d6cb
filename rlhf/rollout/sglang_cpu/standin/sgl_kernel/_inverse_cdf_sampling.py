"""Sampling one token per row by the inverse CDF on the CPU engine (SGLang's plain sampling case).

Why: with no top-k / top-p / min-p, SGLang 0.5.23 samples with ``sampling_from_probs_torch``: the Gumbel-max trick
(``argmax(probs / Exp(1))``, its default) or ``torch.multinomial``, which on CPU draws one exponential variate per
vocabulary entry -- B x V random numbers from torch's single-threaded CPU generator every decode step.  On the
~40M Llama of benchmarks/vs_trl.py (vocabulary 32,000, 64 requests) that was 39% of the scheduler's samples
(py-spy), more than the LM head's matmul; 64 x 32,000 draws took ~95 ms per step either way.

The replacement draws ONE uniform per row and picks the token whose cumulative probability interval holds it:
``cdf = cumsum(probs)`` (float64), ``v = u * cdf[-1]`` kept strictly below the total, ``token = first index with
cdf > v`` (``searchsorted(right=True)``); at a large vocabulary in two levels (blocks, then tokens in the block).
P(token = i) = probs[i] / sum(probs), the same distribution as SGLang's; a token of probability 0 is never chosen
(its interval is empty).  Only the random stream differs.
Requests with a per-request ``sampling_seed`` keep SGLang's seeded path.  GPU engines never import this stand-in.
"""
from __future__ import annotations

import torch

TARGET = "sglang.srt.layers.sampler"


#: tokens per block of the two-level search (vocabularies of at least 4 blocks)
BLOCK = 1024


def inverse_cdf_sample(probs):
    """One token id per row of ``probs``: [B, V] non-negative weights (rows need not sum to 1, each row > 0).

    Returns [B] int32 (SGLang's token id dtype).  Source: inverse transform sampling, e.g. Devroye,
    "Non-Uniform Random Variate Generation" (1986), II.2.  One float64 uniform per row; from 4 blocks of
    :data:`BLOCK` tokens on, the search is two-level (:func:`search_two_level`: the one-level token for the same
    uniform, except within ~1e-7 of a block's edge), which reads the row once instead of a float64 cumulative sum
    over it (a sequential scan: about half of the sampling time at a 32k vocabulary).
    """
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device)
    if probs.shape[1] >= 4 * BLOCK:
        return search_two_level(probs, u)
    return search(probs, u)


def _below(v, total):
    """``v`` kept strictly below ``total`` (a uniform times the total may round up to it)."""
    return torch.minimum(v, torch.nextafter(total, torch.zeros_like(total)))


def search(probs, u):
    """The token whose cumulative-probability interval holds ``u * total`` ([B, V] weights, [B, 1] float64 ``u``
    in [0, 1)): one float64 cumulative sum over the row; [B] int32."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    v = _below(u * total, total)
    return torch.searchsorted(cdf, v, right=True).view(-1).to(torch.int32)


def search_two_level(probs, u, block: int = BLOCK):
    """:func:`search` in two levels: sums of blocks of ``block`` tokens (the last one may be shorter; summed in the
    probabilities' dtype, vectorised -- a float64 sum is 7x slower --, so a block's weight carries a relative rounding
    of ~1e-7, the order of float32 probabilities' own; accumulated in float64), the block whose interval holds
    ``u * total``, then the float64 cumulative sum of that block alone.  A block or token
    of weight 0 is never chosen (empty interval; the residual is kept below the chosen block's own sum, which may
    differ from its first-level sum by rounding).  [B] int32."""
    b, v_size = probs.shape
    p = probs.contiguous()
    full = v_size // block * block
    sums = p.as_strided((b, full // block, block), (v_size, block, 1)).sum(-1)
    if full < v_size:
        sums = torch.cat([sums, p[:, full:].sum(-1, keepdim=True)], 1)
    csum = sums.double().cumsum(-1)
    total = csum[:, -1:]
    v = _below(u * total, total)
    blk = torch.searchsorted(csum, v, right=True)  # [B, 1]
    before = torch.where(blk > 0, csum.gather(1, (blk - 1).clamp(min=0)), torch.zeros_like(v))
    idx = blk * block + torch.arange(block, device=p.device)
    inside = idx < v_size
    vals = torch.where(inside, p.gather(1, idx.clamp(max=v_size - 1)), torch.zeros((), dtype=p.dtype))
    cdf = vals.cumsum(-1, dtype=torch.float64)
    r = _below(v - before, cdf[:, -1:])
    return (blk * block + torch.searchsorted(cdf, r, right=True)).view(-1).to(torch.int32)


def patch(module) -> None:
    """Route ``module.sampling_from_probs_torch`` without a per-request seed to :func:`inverse_cdf_sample`;
    idempotent."""
    original = module.sampling_from_probs_torch
    if getattr(original, "_rlhf_inverse_cdf", False):
        return

    def sampling_from_probs_torch(probs, sampling_seed=None, positions=None):
        if sampling_seed is not None:
            return original(probs, sampling_seed=sampling_seed, positions=positions)
        return inverse_cdf_sample(probs)

    sampling_from_probs_torch._rlhf_inverse_cdf = True
    module.sampling_from_probs_torch = sampling_from_probs_torch


def install() -> None:
    """Patch now when the sampler module is already imported, else when it is."""
    from ._after_import import after_import

    after_import(TARGET, patch)
