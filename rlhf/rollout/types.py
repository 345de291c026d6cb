"""Result types of rollout generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

__all__ = ["RolloutSample", "FINISH_STOP", "FINISH_LENGTH", "FINISH_ABORT"]

FINISH_STOP = "stop"  # a stop token id was generated (it is the last response token)
FINISH_LENGTH = "length"  # max_new_tokens (or the context length) was reached
FINISH_ABORT = "abort"  # SGLang aborted the request (e.g. the prompt does not fit the context)


@dataclass
class RolloutSample:
    """One generated response.

    Attributes:
        prompt_ids: the prompt token ids, as given.
        response_ids: generated token ids, ``len == T``; when ``finish_reason == "stop"`` the last one is the
            stop token.
        response_log_probs: ``len == T`` floats (natural log); ``response_log_probs[t]`` is the sampling
            log-probability of ``response_ids[t]`` (see ``SamplingConfig.temperature`` for the exact definition).
        finish_reason: "stop", "length" or "abort".
        prompt_index: index of the prompt in the caller's batch.
        sample_index: 0..n-1 among the samples of that prompt.
        weight_version: count of weight updates applied to the engine that produced the sample (0 = as loaded).
    """

    prompt_ids: List[int]
    response_ids: List[int]
    response_log_probs: List[float]
    finish_reason: str
    prompt_index: int
    sample_index: int
    weight_version: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)
