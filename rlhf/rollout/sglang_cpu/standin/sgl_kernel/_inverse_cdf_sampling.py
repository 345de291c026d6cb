"""Sampling one token per row by the inverse CDF on the CPU engine (SGLang's plain sampling case).

Why: with no top-k / top-p / min-p, SGLang 0.5.23 samples with ``sampling_from_probs_torch``: the Gumbel-max trick
(``argmax(probs / Exp(1))``, its default) or ``torch.multinomial``, which on CPU draws one exponential variate per
vocabulary entry -- B x V random numbers from torch's single-threaded CPU generator every decode step.  On the
~40M Llama of benchmarks/vs_trl.py (vocabulary 32,000, 64 requests) that was 39% of the scheduler's samples
(py-spy), more than the LM head's matmul; 64 x 32,000 draws took ~95 ms per step either way.

The replacement draws ONE uniform per row and picks the token whose cumulative probability interval holds it:
``cdf = cumsum(probs)`` (float64), ``v = u * cdf[-1]`` kept strictly below the total, ``token = first index with
cdf > v`` (``searchsorted(right=True)``).  P(token = i) = probs[i] / sum(probs), the same distribution as
SGLang's; a token of probability 0 is never chosen (its interval is empty).  Only the random stream differs.
Requests with a per-request ``sampling_seed`` keep SGLang's seeded path.  GPU engines never import this stand-in.
"""
from __future__ import annotations

import torch

TARGET = "sglang.srt.layers.sampler"


def inverse_cdf_sample(probs):
    """One token id per row of ``probs``: [B, V] non-negative weights (rows need not sum to 1, each row > 0).

    Returns [B] int32 (SGLang's token id dtype).  Source: inverse transform sampling, e.g. Devroye,
    "Non-Uniform Random Variate Generation" (1986), II.2.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    v = torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total
    v = torch.minimum(v, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).view(-1).to(torch.int32)


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
