"""Rollout correction (verl's ``algorithm.rollout_correction``): the rollout engine samples from pi_rollout
(SGLang's kernels, an older weight version under off-policy training), the trainer trains pi_theta.  From the
engine's per-token log-probs (``rollout_log_probs``) and the trainer's (``old_log_probs``):

* truncated importance sampling (``rollout_is``: ``token`` or ``sequence``, weights clamped at
  ``rollout_is_threshold``) multiplying the per-token policy loss;
* rejection sampling (``rollout_rs``, rlhf.algorithms.rollout_rs) masking tokens / sequences out of the loss;
* off-policy diagnostics (KL, perplexities, chi^2) and the training-inference mismatch metrics.

A port of verl's verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights, compute_is_metrics,
compute_offpolicy_metrics, compute_rollout_correction_and_rejection_mask, compute_rollout_corr_metrics_from_logprobs)
and verl/utils/debug/metrics.py (calculate_debug_metrics): same formulas, metric names (``rollout_corr/...``,
``training/rollout_probs_diff_*``) and thresholds.  References: Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training" (truncated IS); Liu et al. 2025, "When Speed Kills Stability"
(rejection and the mismatch metrics).  Batches here are whole on every rank, so ``rollout_is_batch_normalize``
normalises over the whole batch (verl's driver computes it over the whole batch as well).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from rlhf.algorithms.masked_ops import masked_mean, masked_sum
from rlhf.algorithms.rollout_corr_config import ROLLOUT_IS_LEVELS, rollout_correction_enabled
from rlhf.algorithms.rollout_rs import SAFETY_BOUND, compute_rollout_rejection_mask

__all__ = ["ROLLOUT_IS_LEVELS", "rollout_correction_enabled", "compute_rollout_correction_weights",
           "compute_is_metrics", "compute_offpolicy_metrics", "compute_rollout_correction_and_rejection_mask",
           "compute_rollout_corr_metrics_from_logprobs", "calculate_debug_metrics", "compute_rollout_rejection_mask"]

def compute_rollout_correction_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str = "token",
                                       rollout_is_threshold: float = 2.0, rollout_is_batch_normalize: bool = False
                                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights [B, R] (0 on padding) and their metrics (:func:`compute_is_metrics`, from the weights
    before truncation).

    token:    w_t = min(exp(clamp(log_ratio_t, -20, 20)), threshold)
    sequence: w_t = min(exp(clamp(sum_t log_ratio_t, -20, 20)), threshold) for every token of the sequence

    `log_ratio` = log pi_train - log pi_rollout [B, R] (nats); with `rollout_is_batch_normalize` the weights are
    divided by their masked mean (token) or mean over sequences (sequence), ``rollout_is_batch_norm_factor``.
    Raises ValueError for another level or a threshold <= 0.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {set(ROLLOUT_IS_LEVELS)}.")
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {rollout_is_threshold}.")
    if rollout_is == "token":
        for_metrics = log_ratio
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        for_metrics = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(for_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * response_mask
    metrics = compute_is_metrics(weights, for_metrics, response_mask, rollout_is, rollout_is_threshold)
    weights = weights.clamp(max=rollout_is_threshold).detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            seq_w = masked_mean(weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def compute_is_metrics(rollout_is_weights: torch.Tensor, log_ratio_for_metrics: torch.Tensor,
                       response_mask: torch.Tensor, rollout_is: str, rollout_is_threshold: float) -> dict[str, float]:
    """verl's compute_is_metrics: ``rollout_is_{mean,max,min,std,ratio_fraction_high,ratio_fraction_low,
    eff_sample_size}`` and ``rollout_is_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}`` of the
    untruncated weights [B, R]; the lower threshold is 1 / threshold; std and the effective sample size
    1 / mean((w / mean w)^2) use the weights clamped to [1/threshold, threshold].  Raises ValueError when
    `response_mask` has no token."""
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    m: dict[str, float] = {}
    lower = 1.0 / rollout_is_threshold
    log_upper = torch.log(torch.tensor(rollout_is_threshold, device=rollout_is_weights.device))
    log_lower = torch.log(torch.tensor(lower, device=rollout_is_weights.device))
    if rollout_is == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        m["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        m["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:
        m["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        m["rollout_is_ratio_fraction_high"] = masked_mean((rollout_is_weights > rollout_is_threshold).float(),
                                                          response_mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((rollout_is_weights < lower).float(), response_mask).item()
        mask_bool = response_mask.bool()
        m["rollout_is_max"] = rollout_is_weights.masked_fill(~mask_bool, float("-inf")).max().item()
        m["rollout_is_min"] = rollout_is_weights.masked_fill(~mask_bool, float("inf")).min().item()
    clamped = rollout_is_weights.clamp(min=lower, max=rollout_is_threshold)
    mean_c = masked_mean(clamped, response_mask)
    if response_mask.sum() > 1:
        var = masked_mean(clamped.square(), response_mask) - mean_c.square()
        m["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    normalized = clamped / (mean_c + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized.square(), response_mask).item()
    if rollout_is_weights.dim() > 1:
        seq = masked_mean(rollout_is_weights, response_mask, axis=-1)
        m["rollout_is_seq_mean"] = seq.mean().item()
        m["rollout_is_seq_std"] = seq.std().item() if seq.numel() > 1 else 0.0
        m["rollout_is_seq_max"] = seq.max().item()
        m["rollout_is_seq_min"] = seq.min().item()
        m["rollout_is_seq_max_deviation"] = (seq - 1.0).abs().max().item()
        m["rollout_is_seq_fraction_high"] = (seq > rollout_is_threshold).float().mean().item()
        m["rollout_is_seq_fraction_low"] = (seq < lower).float().mean().item()
    return m


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor],
                              response_mask: torch.Tensor) -> dict[str, float]:
    """verl's compute_offpolicy_metrics (no prefix), from the trainer's `old_log_prob` and the engine's
    `rollout_log_prob` [B, R] (nats):

    training_ppl / rollout_ppl    batch mean of exp(-mean_t log p) per sequence; *_log_ppl the mean of -mean_t log p
    kl                            mean over tokens of log p_rollout - log p_train (k1 of KL(rollout || train))
    k3_kl                         mean over tokens of exp(r) - r - 1, r = log p_train - log p_rollout
    log_ppl_diff[_max,_min]       per sequence mean_t log p_rollout - mean_t log p_train (mean / max / min);
                                  log_ppl_abs_diff its mean absolute value; ppl_ratio the mean of exp(log_ppl_diff)
    chi2_token                    mean over tokens of exp(clamp(r))^2 - 1
    chi2_seq                      mean over sequences of exp(2 clamp(sum_t r)) - 1

    Raises ValueError when `response_mask` has no token."""
    if not response_mask.any():
        raise ValueError("Expected at least one valid token in response_mask")
    m: dict[str, float] = {}
    mean_train = masked_mean(old_log_prob, response_mask, axis=-1)
    m["training_ppl"] = torch.exp(-mean_train).mean().item()
    m["training_log_ppl"] = (-mean_train).mean().item()
    if rollout_log_prob is None:
        return m
    m["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    log_ratio = old_log_prob - rollout_log_prob
    m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
    mean_rollout = masked_mean(rollout_log_prob, response_mask, axis=-1)
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    m["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_train
    m["log_ppl_diff"] = diff.mean().item()
    m["log_ppl_abs_diff"] = diff.abs().mean().item()
    m["log_ppl_diff_max"] = diff.max().item()
    m["log_ppl_diff_min"] = diff.min().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    m["chi2_token"] = (masked_mean(rho.square(), response_mask) - 1.0).item()
    seq_sum = torch.clamp(masked_sum(log_ratio, response_mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * seq_sum).mean() - 1.0).item()
    return m


def _prefixed(metrics: dict) -> dict[str, float]:
    return {f"rollout_corr/{k}": (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}


def compute_rollout_correction_and_rejection_mask(
        old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
        rollout_is: Optional[str] = None, rollout_is_threshold: Optional[float] = 2.0,
        rollout_is_batch_normalize: bool = False, rollout_rs: Optional[str] = None,
        rollout_rs_threshold=None) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """verl's entry point: (IS weights [B, R] or None when `rollout_is` is None, the response mask [B, R] with the
    rejected tokens set to 0, metrics prefixed ``rollout_corr/``: IS, rejection and off-policy ones).

    verl returns the weights in a DataProto under ``rollout_is_weights``; here the tensor itself.
    Raises ValueError for mismatched shapes, an empty mask, a bad level / option / threshold, or `rollout_rs`
    without `rollout_rs_threshold`.
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"old_log_prob shape {old_log_prob.shape} does not match rollout_log_prob shape "
                         f"{rollout_log_prob.shape}.")
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(f"log_prob shape {old_log_prob.shape} does not match response_mask shape "
                         f"{response_mask.shape}.")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(log_ratio, response_mask, rollout_is,
                                                                 rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
                             "Set rollout_rs_threshold to the desired threshold value.")
        mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, _prefixed(metrics)


def compute_rollout_corr_metrics_from_logprobs(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                                               response_mask: torch.Tensor) -> dict[str, float]:
    """The off-policy metrics of the CURRENT policy's `log_prob` against the engine's (verl's actor computes them
    per micro batch during the update), prefixed ``rollout_corr/``."""
    return _prefixed(compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask))


def calculate_debug_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                            response_mask: torch.Tensor) -> dict[str, float]:
    """The training-inference mismatch metrics of verl's calculate_debug_metrics (verl/utils/debug/metrics.py),
    over the response tokens of [B, R] log-probs, on PROBABILITIES p = exp(log p):

    training/rollout_probs_diff_valid         1
    training/rollout_probs_diff_{max,mean,std} of |p_train - p_rollout| (std: unbiased)
    training/rollout_actor_probs_pearson_corr Pearson correlation of p_train and p_rollout (arXiv:2506.13585)
    """
    sel = response_mask.bool()
    actor, rollout = torch.exp(old_log_probs), torch.exp(rollout_log_probs)
    a, r = torch.masked_select(actor, sel), torch.masked_select(rollout, sel)
    diff = (a - r).abs()
    return {"training/rollout_probs_diff_valid": 1,
            "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": diff.std().item(),
            "training/rollout_actor_probs_pearson_corr": torch.corrcoef(torch.stack([a, r]))[0][1].item()}
