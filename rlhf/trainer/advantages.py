"""The PPO step's algorithm inputs: which samples count and the advantages.

    samples --(reward validity: rlhf.rewards.validity, ReMax baselines: rlhf.trainer.remax, in sample.extra)-->
    sample_masks(): sample_valid [N], reward_baselines [N], loss_mask [N, R]
    --> compute_advantages() through rlhf.algorithms' registry

Unscorable samples (``reward.exclude_unscorable``, default true) are left out of their group's baseline (the
estimators' ``sample_mask``), get advantage 0 and are left out of the policy and value losses
(``loss_mask``); ``reward/num_unscorable`` counts such samples.

Overlong filtering (``algorithm.overlong_filter``, DAPO, Yu et al. 2025, arXiv:2503.14476, sec. 3.4):
responses the engine cut at ``data.max_response_length`` (finish reason "length") are masked out of
the losses (``actor/num_overlong_filtered``); their rewards still count in the group baselines (a
truncated response is a real, if unfinished, answer).
"""
from __future__ import annotations

import numpy as np
import torch

from rlhf import algorithms as algos

__all__ = ["compute_advantages", "sample_masks", "apply_rollout_correction", "mismatch_metrics",
           "RS_RESPONSE_MASK_KEY"]

#: the response mask without the tokens rollout rejection sampling rejected (verl's modified ``response_mask``)
RS_RESPONSE_MASK_KEY = "rs_response_mask"


def sample_masks(batch: dict, samples, cfg) -> dict:
    """Fill batch["sample_valid"] [N] bool (reward, and ReMax baseline, scorable; all True unless
    ``reward.exclude_unscorable``; False for a sample whose rollout failed, ``extra["rollout_failed"]``), batch["reward_baselines"] [N] (ReMax) and batch["loss_mask"] [N, R]
    (the response mask of the valid samples, without truncated ones under ``algorithm.overlong_filter``;
    needs batch["truncated"]).  Returns reward/num_unscorable (and actor/num_overlong_filtered)."""
    exclude = cfg.reward.exclude_unscorable
    valid = torch.tensor([bool(s.extra.get("reward_valid", True)) or not exclude for s in samples])
    if cfg.algorithm.adv_estimator == "remax":
        batch["reward_baselines"] = torch.tensor([float(s.extra["reward_baseline"]) for s in samples])
        valid &= torch.tensor([bool(s.extra["baseline_valid"]) or not exclude for s in samples])
    metrics = {"reward/num_unscorable": float((~valid).sum())}
    # a sample the rollout could not produce even on its greedy retry (rlhf.rollout.fallback) never trains
    # (counted in rollout/num_failed_samples)
    valid &= torch.tensor([not s.extra.get("rollout_failed", False) for s in samples])
    keep = valid.clone()
    if cfg.algorithm.overlong_filter:
        filtered = valid & batch["truncated"]
        keep &= ~filtered
        metrics["actor/num_overlong_filtered"] = float(filtered.sum())
    batch["sample_valid"] = valid
    mask = batch["response_mask"]
    batch["loss_mask"] = mask * keep.unsqueeze(1).to(mask.dtype)
    return metrics


def compute_advantages(batch: dict, uids: np.ndarray, acfg, kl_ctrl) -> dict:
    """Fill batch["token_level_rewards"] (scores, minus the KL penalty when ``use_kl_in_reward``: Ziegler
    et al. 2019 eq. 2, the controller fed the SEQUENCE KL), batch["advantages"] and batch["returns"]
    ([N, R]) with ``algorithm.adv_estimator`` from rlhf.algorithms' registry, called as verl's trainer does:
    ``fn(token_level_rewards=, response_mask=, index=uids, config=acfg, sample_mask=, values= (gae),
    reward_baselines= (remax))``.  `uids` [N] groups the samples of one prompt; `acfg` is the config's
    ``algorithm`` section; batch["sample_valid"] (optional, [N]) excludes samples from the baselines.
    Returns the KL-penalty metrics.  Raises ValueError from the estimator (e.g. a non-finite valid reward,
    grpo_passk with groups of one)."""
    mask, metrics = batch["response_mask"], {}
    if acfg.use_kl_in_reward:
        batch["token_level_rewards"], metrics = algos.apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"], mask, kl_ctrl, acfg.kl_penalty)
    else:
        batch["token_level_rewards"] = batch["token_level_scores"]
    est = acfg.adv_estimator
    extra = {"values": batch["values"]} if est == "gae" else {}
    if est == "gae" and RS_RESPONSE_MASK_KEY in batch:  # verl: GAE runs on the response mask with rejection applied
        mask = batch[RS_RESPONSE_MASK_KEY]
    if est == "remax":
        extra["reward_baselines"] = batch["reward_baselines"]
    batch["advantages"], batch["returns"] = algos.get_adv_estimator_fn(est)(
        token_level_rewards=batch["token_level_rewards"], response_mask=mask, index=uids, config=acfg,
        sample_mask=batch.get("sample_valid"), **extra)
    return metrics


def mismatch_metrics(batch: dict) -> dict:
    """verl's training-inference mismatch metrics (``training/rollout_probs_diff_*``,
    ``training/rollout_actor_probs_pearson_corr``; rlhf.algorithms.rollout_corr.calculate_debug_metrics) of the
    trainer's ``old_log_probs`` against the engine's ``rollout_log_probs`` over the response tokens; {} for a batch
    without a response token."""
    from rlhf.algorithms.rollout_corr import calculate_debug_metrics

    mask = batch["response_mask"]
    if not bool(mask.any()):
        return {}
    return calculate_debug_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask)


def apply_rollout_correction(batch: dict, rc) -> dict:
    """verl's compute_rollout_correction_and_add_to_batch (decoupled mode; nothing in ``bypass_mode``, where the
    loss computes it): from batch["old_log_probs"] and batch["rollout_log_probs"] over batch["response_mask"]
    [N, R], the truncated IS weights as batch["rollout_is_weights"] [N, R] (when ``rc.rollout_is`` is set) and the
    rejection (``rc.rollout_rs``) applied to batch["loss_mask"], which the policy and value losses read.  Returns
    the ``rollout_corr/...`` metrics (IS, rejection, off-policy: always, as verl's trainer logs them whenever the
    rollout log-probs exist).  verl masks its response_mask before the advantages; here the losses (actor and
    critic) read the kept tokens from ``loss_mask`` and GAE reads them from batch["rs_response_mask"] [N, R]
    (compute_advantages): its recursion skips a rejected token like a tool observation (its value and reward
    never reach a kept token's advantage or return) and the whitening counts only kept tokens, as in verl.  The
    outcome-reward estimators keep the whole response (their advantages are the sequence's score on every
    token; verl's sum the rewards unmasked too), so a rejected last token still carries the score."""
    from rlhf.algorithms.rollout_corr import compute_rollout_correction_and_rejection_mask

    mask = batch["response_mask"]
    if rc.bypass_mode or not bool(mask.any()):
        return {}
    threshold = rc.rollout_rs_threshold
    weights, kept, metrics = compute_rollout_correction_and_rejection_mask(
        batch["old_log_probs"], batch["rollout_log_probs"], mask, rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs, rollout_rs_threshold=threshold)
    if weights is not None:
        batch["rollout_is_weights"] = weights
    if rc.rollout_rs is not None:
        batch["loss_mask"] = batch["loss_mask"] * kept.to(batch["loss_mask"].dtype)
        batch[RS_RESPONSE_MASK_KEY] = mask * kept.to(mask.dtype)
    return metrics
