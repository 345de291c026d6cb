"""Rollout batch: generated samples -> padded tensors; data-parallel slicing and gathering.

Layout of one batch of N = prompts x n sequences, P = longest prompt, R = max_response_length::

    input_ids      [N, P + R]  left-padded prompt | right-padded response
    attention_mask [N, P + R]  1 on real tokens
    position_ids   [N, P + R]  0 at the first real token
    responses      [N, R]      response token ids (pad after the end)
    response_mask  [N, R]      1 on response tokens (the stop token included)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def build_rollout_batch(samples, pad_token_id: int, max_response_length: int) -> dict:
    """Pad a list of RolloutSample into the tensors above (plus `rollout_log_probs` [N, R]).

    Raises ValueError when a response is longer than max_response_length.
    """
    if not samples:
        raise ValueError("no rollout samples to batch")
    P = max(len(s.prompt_ids) for s in samples)
    R = max_response_length
    N = len(samples)
    input_ids = torch.full((N, P + R), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((N, P + R), dtype=torch.long)
    response_mask = torch.zeros((N, R), dtype=torch.long)
    rollout_log_probs = torch.zeros((N, R), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if r > R:
            raise ValueError(f"response of {r} tokens exceeds max_response_length={R}")
        input_ids[i, P - p:P] = torch.tensor(s.prompt_ids)
        attention_mask[i, P - p:P] = 1
        if r:
            input_ids[i, P:P + r] = torch.tensor(s.response_ids)
            attention_mask[i, P:P + r] = 1
            response_mask[i, :r] = 1
            rollout_log_probs[i, :r] = torch.tensor(s.response_log_probs[:r], dtype=torch.float32)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                responses=input_ids[:, P:].clone(), response_mask=response_mask,
                rollout_log_probs=rollout_log_probs, prompt_length=P)


def outcome_token_scores(scores, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last response token: [N] -> [N, R].
    An empty response keeps its score at position 0 (masked out downstream)."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    lengths = response_mask.sum(1)
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(len(scores)), (lengths - 1).clamp(min=0)] = scores
    return out


def dp_slice(t: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's contiguous slice of dim 0 (must divide evenly)."""
    n = t.shape[0]
    if n % dp_size:
        raise ValueError(f"batch of {n} sequences does not split over data-parallel size {dp_size}; "
                         f"make data.train_batch_size * rollout.n divisible by it")
    k = n // dp_size
    return t[dp_rank * k:(dp_rank + 1) * k]


def dp_all_gather(t: torch.Tensor, group, dp_size: int) -> torch.Tensor:
    """Concatenate every data-parallel rank's [k, ...] tensor along dim 0 (rank order)."""
    if dp_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dp_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, 0)
