"""Step metrics, with verl's names: timers, the rollout batch's data metrics, throughput."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rlhf import algorithms as algos

__all__ = ["timer", "compute_data_metrics", "add_step_timing"]


@contextmanager
def timer(metrics: dict, name: str):
    """Time the block into ``metrics["timing/<name>"]`` (seconds)."""
    start = time.perf_counter()
    yield
    metrics[f"timing/{name}"] = time.perf_counter() - start


def compute_data_metrics(batch: dict, scores, max_response_length: int) -> dict:
    """Metrics of one PPO batch ([N, R] tensors of rlhf.workers.batch plus ``token_level_rewards``,
    ``advantages``, ``returns``, ``old_log_probs``, ``rollout_log_probs``, and ``ref_log_probs`` /
    ``values`` when present) and its N raw `scores`:

    critic/score/{mean,max,min}, critic/rewards/mean (summed token rewards), critic/advantages/mean,
    critic/returns/mean, critic/values/mean (with a critic), response_length/{mean,max,clip_ratio}
    (fraction at max_response_length), actor/kl (mean old - ref log-prob over response tokens; 0 without
    a reference), actor/rollout_log_prob_diff (mean |trainer - engine| log-prob).
    """
    mask = batch["response_mask"]
    scores_t = torch.tensor(scores, dtype=torch.float32)
    lengths = mask.sum(1).float()
    m = {
        "critic/score/mean": scores_t.mean().item(), "critic/score/max": scores_t.max().item(),
        "critic/score/min": scores_t.min().item(),
        "critic/rewards/mean": batch["token_level_rewards"].sum(1).mean().item(),
        "critic/advantages/mean": algos.masked_mean(batch["advantages"], mask).item(),
        "critic/returns/mean": algos.masked_mean(batch["returns"], mask).item(),
        "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": (lengths >= max_response_length).float().mean().item(),
        "actor/kl": algos.masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask).item()
        if "ref_log_probs" in batch else 0.0,
        "actor/rollout_log_prob_diff": algos.masked_mean((batch["old_log_probs"] - batch["rollout_log_probs"]).abs(),
                                                         mask).item(),
    }
    if "values" in batch:
        m["critic/values/mean"] = algos.masked_mean(batch["values"], mask).item()
    return m


def add_step_timing(metrics: dict, seconds: float, tokens: float, world_size: int) -> dict:
    """timing/step (seconds) and perf/throughput: tokens (prompt + response) processed per second per
    trainer device."""
    metrics["timing/step"] = seconds
    metrics["perf/throughput"] = tokens / seconds / world_size
    return metrics
