"""Step metrics, with verl's names and formulas (verl/trainer/ppo/metric_utils.py): timers (and GPU memory
per phase), the rollout batch's data metrics (compute_data_metrics), per-token timings
(compute_timing_metrics), throughput (compute_throughout_metrics), distributions; validation metrics per
data source are rlhf.trainer.val_metrics."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rlhf import algorithms as algos

from . import profiling
from .tracking import Histogram

__all__ = ["timer", "compute_data_metrics", "compute_timing_metrics", "rollout_metrics", "add_step_timing",
           "PER_TOKEN_PHASES"]

_GB = float(1 << 30)
#: verl's compute_timing_metrics: the phases divided by a token count; gen by the response tokens, the
#: others by every token (prompt + response)
PER_TOKEN_PHASES = ("gen", "ref", "values", "adv", "update_critic", "update_actor")


@contextmanager
def timer(metrics: dict, name: str):
    """Time the block into ``metrics["timing_s/<name>"]`` (seconds, verl's name).  On GPU also the trainer
    process's peak memory during the block, ``memory/<name>/max_allocated_gb`` and
    ``memory/<name>/max_reserved_gb`` (GiB, torch.cuda.max_memory_allocated / max_memory_reserved after a peak
    reset); nothing on CPU.  Under Nsight Systems on a CUDA device the block is also an NVTX range `name`
    (rlhf.trainer.profiling)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with profiling.nvtx_range(name):
        yield
    metrics[f"timing_s/{name}"] = time.perf_counter() - start
    if cuda:
        metrics[f"memory/{name}/max_allocated_gb"] = torch.cuda.max_memory_allocated() / _GB
        metrics[f"memory/{name}/max_reserved_gb"] = torch.cuda.max_memory_reserved() / _GB


def _stats(prefix: str, x: torch.Tensor) -> dict:
    """``<prefix>/{mean,max,min}`` of a 1-D tensor (0.0 each when it is empty: no response token at all)."""
    if x.numel() == 0:
        return {f"{prefix}/{k}": 0.0 for k in ("mean", "max", "min")}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def compute_data_metrics(batch: dict, max_response_length: int, max_prompt_length: int | None = None) -> dict:
    """Metrics of one PPO batch ([N, P + R] ``attention_mask``, [N, R] ``response_mask``, ``token_level_scores``,
    ``token_level_rewards``, ``advantages``, ``returns``, ``old_log_probs``, ``rollout_log_probs``, and
    ``ref_log_probs`` / ``values`` when present; ``prompt_length`` = P, rlhf.workers.batch).  verl's
    compute_data_metrics (verl/trainer/ppo/metric_utils.py), same names and formulas:

    critic/score/{mean,max,min}          per sequence: sum of token_level_scores (the reward's score, with DAPO's
                                         overlong penalty folded in as verl's DAPO reward manager does), over
                                         the sequences that are not aborted
    critic/rewards/{mean,max,min}        per sequence: sum of token_level_rewards (score - KL penalty), not aborted
    critic/advantages/{mean,max,min}     over response tokens (response_mask)
    critic/returns/{mean,max,min}        over response tokens
    critic/values/{mean,max,min}         (with a critic) over response tokens
    critic/vf_explained_var              (with a critic) 1 - Var(returns - values) / (Var(returns) + 1e-5),
                                         unbiased variances over response tokens
    response_length/{mean,max,min}       response tokens per sequence
    response_length/clip_ratio           fraction of sequences with max_response_length tokens
    response_length_non_aborted/{mean,max,min,clip_ratio}   the same over the sequences that are not aborted
    response/aborted_ratio               fraction of sequences with an empty response (aborted)
    prompt_length/{mean,max,min}         prompt tokens per sequence (attention_mask[:, :P])
    prompt_length/clip_ratio             fraction of prompts with max_prompt_length tokens (verl pads prompts
                                         to data.max_prompt_length and compares with that width; batches here
                                         are padded to the longest prompt, so the limit is passed in; default P)

    and two of ours: actor/kl (mean old - ref log-prob over response tokens; 0 without a reference),
    actor/rollout_log_prob_diff (mean |trainer - engine| log-prob).  Where every response is aborted verl raises;
    here the score / reward / non-aborted statistics are then over all sequences (response/aborted_ratio = 1 says
    so).
    """
    mask = batch["response_mask"]
    valid = mask.bool()
    P = batch["prompt_length"]
    lengths = batch["attention_mask"][:, P:].sum(1).float()  # verl's: every response token (tool tokens too)
    aborted = lengths == 0
    kept = ~aborted if bool((~aborted).any()) else torch.ones_like(aborted)
    prompt_lengths = batch["attention_mask"][:, :P].sum(1).float()
    max_prompt = P if max_prompt_length is None else max_prompt_length
    returns = batch["returns"][valid]
    kept_lengths = lengths[kept]
    m = {
        **_stats("critic/score", batch["token_level_scores"].sum(1)[kept]),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(1)[kept]),
        **_stats("critic/advantages", batch["advantages"][valid]),
        **_stats("critic/returns", returns),
        **_stats("response_length", lengths),
        "response_length/clip_ratio": (lengths == max_response_length).float().mean().item(),
        **_stats("response_length_non_aborted", kept_lengths),
        "response_length_non_aborted/clip_ratio": (kept_lengths == max_response_length).float().mean().item(),
        "response/aborted_ratio": aborted.float().mean().item(),
        **_stats("prompt_length", prompt_lengths),
        "prompt_length/clip_ratio": (prompt_lengths == max_prompt).float().mean().item(),
        "actor/kl": algos.masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask).item()
        if "ref_log_probs" in batch else 0.0,
        "actor/rollout_log_prob_diff": algos.masked_mean((batch["old_log_probs"] - batch["rollout_log_probs"]).abs(),
                                                         mask).item(),
    }
    if "values" in batch:
        values = batch["values"][valid]
        m.update(_stats("critic/values", values))
        m["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)).item()
    return m


def compute_timing_metrics(metrics: dict, batch: dict) -> dict:
    """``timing_per_token_ms/<phase>`` for the ``timing_s/<phase>`` of :data:`PER_TOKEN_PHASES` in `metrics`:
    milliseconds per token, gen per response token (``response_mask``), the others per token of the batch
    (``attention_mask``: prompt + response).  verl's compute_timing_metrics."""
    response_tokens = float(batch["response_mask"].sum())
    all_tokens = float(batch["attention_mask"].sum())
    return {f"timing_per_token_ms/{name}": metrics[f"timing_s/{name}"] * 1000
            / max(response_tokens if name == "gen" else all_tokens, 1.0)
            for name in PER_TOKEN_PHASES if f"timing_s/{name}" in metrics}


def rollout_metrics(batch: dict, gen_seconds: float) -> dict:
    """Distributions of one rollout batch ([N, R] ``response_mask`` and ``token_level_scores``) and the generation
    speed: ``critic/score/hist`` and ``response_length/hist`` (Histograms of the N sequence scores, as
    critic/score/mean counts them, and of the response lengths in tokens), ``perf/rollout_tokens_per_s``
    (response tokens generated / `gen_seconds`, the generate phase without the reward: timing_s/gen)."""
    lengths = batch["response_mask"].sum(1).float()
    return {"critic/score/hist": Histogram(batch["token_level_scores"].sum(1).tolist()),
            "response_length/hist": Histogram(lengths.tolist()),
            "perf/rollout_tokens_per_s": float(lengths.sum()) / max(gen_seconds, 1e-9)}


def add_step_timing(metrics: dict, seconds: float, tokens: float, world_size: int) -> dict:
    """verl's compute_throughout_metrics: ``timing_s/step`` and ``perf/time_per_step`` (seconds),
    ``perf/total_num_tokens`` (`tokens`: prompt + response tokens of the step's batch) and ``perf/throughput``
    (tokens / (seconds x trainer devices))."""
    metrics["timing_s/step"] = metrics["perf/time_per_step"] = seconds
    metrics["perf/total_num_tokens"] = tokens
    metrics["perf/throughput"] = tokens / (seconds * world_size)
    return metrics
