"""Rollout rejection sampling (verl's ``algorithm.rollout_correction.rollout_rs``): a hard trust region that masks
the tokens / sequences whose divergence between the training policy and the rollout engine's policy leaves a
threshold.  A port of verl's verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_rejection_mask,
compute_rs_metrics, _parse_rollout_rs_thresholds): same options, thresholds, formulas and metric names (without
the ``rollout_corr/`` prefix, which rlhf.algorithms.rollout_corr adds).

Per token, with log_ratio = log pi_train - log pi_rollout clamped to [-20, 20] (verl's SAFETY_BOUND):
k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio (Schulman's KL estimators of
KL(pi_rollout || pi_train)); ``token_k*`` compares each token's value, ``seq_sum_k*`` / ``seq_mean_k*`` /
``seq_max_k*`` the sequence's sum / mean / max over its response tokens.  k1 options keep values in
[log lower, log upper] (a threshold ``"lower_upper"``, or one number u meaning [1/u, u]); the others keep
values <= the threshold.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from rlhf.algorithms.masked_ops import masked_mean, masked_sum
from rlhf.algorithms.rollout_corr_config import (SUPPORTED_ROLLOUT_RS_OPTIONS, TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
                                                 parse_rollout_rs_thresholds, rs_options)

__all__ = ["SAFETY_BOUND", "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
           "parse_rollout_rs_thresholds", "compute_rollout_rejection_mask", "compute_rs_metrics"]

#: clamp of log ratios before exp() (verl's value: exp(20) ~ 4.9e8)
SAFETY_BOUND = 20.0


def _seq_max(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Max over each row's response tokens (0 for a row without any)."""
    neg_inf = torch.tensor(float("-inf"), device=values.device, dtype=values.dtype)
    m = values.masked_fill(~response_mask.bool(), neg_inf).max(dim=-1).values
    return torch.where(m == neg_inf, torch.zeros_like(m), m)


def compute_rollout_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str = "token_k1",
                                   rollout_rs_threshold=None) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask [B, R] with the rejected tokens / sequences set to 0, and the metrics (module docstring).

    Args:
        log_ratio: log pi_train - log pi_rollout, nats, [B, R].
        response_mask: 1 on response tokens, [B, R].
        rollout_rs: comma-separated options; every one must pass for a token to stay.
        rollout_rs_threshold: one threshold, or one per option (comma separated); see
            :func:`parse_rollout_rs_thresholds`.

    Metrics, per option o: ``rollout_rs_<o>_{mean,max,min,std,fraction_high,fraction_low,seq_mean,seq_std,seq_max,
    seq_min,seq_max_deviation,seq_fraction_high[,seq_fraction_low]}`` (:func:`compute_rs_metrics`),
    ``rollout_rs_<o>_masked_fraction`` / ``_seq_masked_fraction``; overall ``rollout_rs_masked_fraction`` (tokens)
    and ``rollout_rs_seq_masked_fraction`` (sequences with a rejected token).

    Raises ValueError for an unknown option or a bad threshold (verl's messages).
    """
    options = rs_options(rollout_rs)
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    specs = parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    mask_bool = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        k = option[-2:]
        upper, lower = specs[option]["upper"], specs[option]["lower"]
        is_k1 = k == "k1"
        lower_log = math.log(lower) if is_k1 else None
        upper_log = math.log(upper) if is_k1 else None
        tok = per_token[k]
        seq_stat = None
        if option in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS:
            stat = tok
            keep = (stat >= lower_log) & (stat <= upper_log) if is_k1 else stat <= upper
        else:
            if option.startswith("seq_sum"):
                seq_stat = masked_sum(tok, response_mask, axis=-1)
            elif option.startswith("seq_mean"):
                seq_stat = masked_mean(tok, response_mask, axis=-1)
            else:
                seq_stat = _seq_max(tok, response_mask)
            seq_keep = (seq_stat >= lower_log) & (seq_stat <= upper_log) if is_k1 else seq_stat <= upper
            keep = seq_keep.unsqueeze(-1).expand_as(mask_bool)
            stat = seq_stat.unsqueeze(-1).expand_as(response_mask)
        metrics.update(compute_rs_metrics(
            option, stat, response_mask, seq_valid, level="token" if seq_stat is None else "sequence",
            per_sequence_values=seq_stat, rollout_rs_threshold=upper_log if is_k1 else upper,
            rollout_rs_threshold_lower=lower_log if is_k1 else 0.0, apply_lower_threshold=is_k1))
        keep_f = keep.to(dtype=log_ratio.dtype)
        combined = combined * keep_f
        seq_keep_all = (~((~keep) & mask_bool)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_f, response_mask).item()
        valid_f = seq_valid.float()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            ((1.0 - seq_keep_all.to(log_ratio.dtype)) * valid_f).sum() / valid_f.sum()).item() \
            if valid_f.sum() > 0 else 0.0
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    final_keep = (combined > 0.5) & mask_bool
    metrics["rollout_rs_seq_masked_fraction"] = (~final_keep & mask_bool).any(dim=-1).float().mean().item()
    return (response_mask * combined).to(dtype=response_mask.dtype), metrics


def compute_rs_metrics(option_name: str, rs_statistic: torch.Tensor, response_mask: torch.Tensor,
                       seq_valid_mask: torch.Tensor, *, level: str, per_sequence_values: Optional[torch.Tensor],
                       rollout_rs_threshold: float, rollout_rs_threshold_lower: float,
                       apply_lower_threshold: bool) -> dict[str, float]:
    """verl's compute_rs_metrics for one option: statistics of `rs_statistic` [B, R] (per token; a sequence option
    repeats its per-sequence value [B] along R) against the thresholds (in log space for k1 options).
    Raises ValueError when `response_mask` has no token."""
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    p, m, mask_bool = f"rollout_rs_{option_name}", {}, response_mask.bool()
    seq_values = per_sequence_values if per_sequence_values is not None \
        else masked_mean(rs_statistic, response_mask, axis=-1)
    if seq_values.dim() > 1:
        seq_values = seq_values.squeeze(-1)
    sv = seq_values[seq_valid_mask]
    m[f"{p}_mean"] = masked_mean(rs_statistic, response_mask).item()
    if level == "sequence" and sv.numel() > 0:
        m[f"{p}_max"], m[f"{p}_min"] = sv.max().item(), sv.min().item()
        high = (sv > rollout_rs_threshold).float().mean().item()
        low = (sv < rollout_rs_threshold_lower).float().mean().item() if apply_lower_threshold else 0.0
    else:
        m[f"{p}_max"] = rs_statistic.masked_fill(~mask_bool, float("-inf")).max().item()
        m[f"{p}_min"] = rs_statistic.masked_fill(~mask_bool, float("inf")).min().item()
        high = masked_mean((rs_statistic > rollout_rs_threshold).float(), response_mask).item()
        low = masked_mean((rs_statistic < rollout_rs_threshold_lower).float(), response_mask).item() \
            if apply_lower_threshold else 0.0
    m[f"{p}_fraction_high"], m[f"{p}_fraction_low"] = high, low
    if response_mask.sum() > 1:
        clamped = rs_statistic.clamp(min=rollout_rs_threshold_lower if apply_lower_threshold else 0.0,
                                     max=rollout_rs_threshold)
        mean = masked_mean(clamped, response_mask)
        m[f"{p}_std"] = torch.sqrt(torch.clamp(masked_mean(clamped.square(), response_mask) - mean.square(),
                                               min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    if sv.numel() > 0:
        m[f"{p}_seq_mean"] = sv.mean().item()
        m[f"{p}_seq_std"] = sv.std().item() if sv.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = sv.max().item(), sv.min().item()
        m[f"{p}_seq_max_deviation"] = sv.abs().max().item()
        m[f"{p}_seq_fraction_high"] = (sv > rollout_rs_threshold).float().mean().item()
        if apply_lower_threshold:
            m[f"{p}_seq_fraction_low"] = (sv < rollout_rs_threshold_lower).float().mean().item()
    else:
        for key in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                    "seq_fraction_low"):
            m[f"{p}_{key}"] = 0.0
    return m
