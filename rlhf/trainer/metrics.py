"""Step metrics, with verl's names: timers (and GPU memory per phase), the rollout batch's data metrics and
distributions, throughput; validation metrics per data source (rlhf.trainer.val_metrics)."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rlhf import algorithms as algos

from .tracking import Histogram

__all__ = ["timer", "compute_data_metrics", "rollout_metrics", "add_step_timing"]

_GB = float(1 << 30)


@contextmanager
def timer(metrics: dict, name: str):
    """Time the block into ``metrics["timing/<name>"]`` (seconds).  On GPU also the trainer process's peak
    memory during the block, ``memory/<name>/max_allocated_gb`` and ``memory/<name>/max_reserved_gb`` (GiB,
    torch.cuda.max_memory_allocated / max_memory_reserved after a peak reset); nothing on CPU."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    yield
    metrics[f"timing/{name}"] = time.perf_counter() - start
    if cuda:
        metrics[f"memory/{name}/max_allocated_gb"] = torch.cuda.max_memory_allocated() / _GB
        metrics[f"memory/{name}/max_reserved_gb"] = torch.cuda.max_memory_reserved() / _GB


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


def rollout_metrics(batch: dict, scores, gen_seconds: float) -> dict:
    """Distributions of one rollout batch ([N, R] ``response_mask``, N raw `scores`) and the generation speed:
    ``critic/score/hist`` and ``response_length/hist`` (Histograms of the N scores / response lengths in
    tokens), ``perf/rollout_tokens_per_s`` (response tokens generated / `gen_seconds`, the generate phase
    including the reward)."""
    lengths = batch["response_mask"].sum(1).float()
    return {"critic/score/hist": Histogram([float(x) for x in scores]),
            "response_length/hist": Histogram(lengths.tolist()),
            "perf/rollout_tokens_per_s": float(lengths.sum()) / max(gen_seconds, 1e-9)}


def add_step_timing(metrics: dict, seconds: float, tokens: float, world_size: int) -> dict:
    """timing/step (seconds) and perf/throughput: tokens (prompt + response) processed per second per
    trainer device."""
    metrics["timing/step"] = seconds
    metrics["perf/throughput"] = tokens / seconds / world_size
    return metrics
