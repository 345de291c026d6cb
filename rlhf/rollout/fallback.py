"""Rollout fault tolerance: a sample whose generation failed is generated
again with greedy decoding, for that sample alone, and the batch goes on.

A sample failed when the engine aborted its request (``finish_reason == "abort"``: an error on that request),
returned no token, or returned a non-finite log-prob.  :func:`failed_samples` finds them, the caller
generates ``[samples[k].prompt_ids for k in failed]`` once more with :func:`greedy_retry_sampling` (n=1,
temperature 0), and :func:`merge_retries` puts the new responses in their place (same prompt_index and
sample_index) and returns the counters:

    rollout/num_fallbacks       samples regenerated greedily (every failed sample)
    rollout/num_failed_samples  of those, samples whose greedy retry failed too (kept, flagged in
                                ``extra["rollout_failed"]``)

Used by rlhf.workers.rollout.RolloutWorker.generate.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from typing import List, Optional, Sequence

from .sampling import SamplingConfig
from .types import FINISH_ABORT, RolloutSample

__all__ = ["sample_failure", "failed_samples", "greedy_retry_sampling", "merge_retries"]

logger = logging.getLogger(__name__)


def sample_failure(sample: RolloutSample) -> Optional[str]:
    """Why `sample` is not a usable generation ("abort", "empty", "non-finite log-prob"), or None."""
    if sample.finish_reason == FINISH_ABORT:
        return "abort"
    if not sample.response_ids:
        return "empty"
    if not all(math.isfinite(x) for x in sample.response_log_probs):
        return "non-finite log-prob"
    return None


def failed_samples(samples: Sequence[RolloutSample]) -> List[int]:
    """Indices (into `samples`) of the samples whose generation failed (see :func:`sample_failure`)."""
    return [k for k, s in enumerate(samples) if sample_failure(s) is not None]


def greedy_retry_sampling(sampling: SamplingConfig) -> SamplingConfig:
    """`sampling` for the retry: one greedy response per prompt (temperature 0, no top-p/top-k, no seed),
    same length limit and stop tokens."""
    return dataclasses.replace(sampling, n=1, temperature=0.0, top_p=1.0, top_k=-1, seed=None)


def merge_retries(samples: List[RolloutSample], failed: Sequence[int], retried: Sequence[RolloutSample]) -> dict:
    """Put ``retried[i]``'s response in place of ``samples[failed[i]]`` (in place; prompt_index and
    sample_index kept; ``extra["rollout_fallback"]`` = why it failed).  Returns the counters
    ``rollout/num_fallbacks`` and ``rollout/num_failed_samples`` (floats), and logs them in one warning
    (how many samples of the batch failed, why, how many still failed after the retry).

    Raises:
        ValueError: ``len(retried) != len(failed)``.
    """
    if len(retried) != len(failed):
        raise ValueError(f"merge_retries: {len(retried)} retried samples for {len(failed)} failed ones")
    still, reasons = 0, Counter()
    for k, new in zip(failed, retried):
        old = samples[k]
        why = sample_failure(old)
        reasons[why or "failed"] += 1
        samples[k] = dataclasses.replace(new, prompt_ids=old.prompt_ids, prompt_index=old.prompt_index,
                                         sample_index=old.sample_index,
                                         extra=dict(new.extra, rollout_fallback=why or "failed"))
        if sample_failure(samples[k]) is not None:
            samples[k].extra["rollout_failed"] = True
            still += 1
    if failed:
        why = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
        logger.warning("rollout: %d of %d samples failed (%s) and were regenerated greedily; %d failed again "
                       "(rollout/num_fallbacks, rollout/num_failed_samples)", len(failed), len(samples), why, still)
    return {"rollout/num_fallbacks": float(len(failed)), "rollout/num_failed_samples": float(still)}
