"""The PPO step's algorithm inputs: which samples count, the advantages, and the checks made before
anything is built.

    samples --(reward validity, ReMax baselines in sample.extra)--> sample_masks(): sample_valid [N],
    reward_baselines [N], loss_mask [N, R] --> compute_advantages() through rlhf.algorithms' registry

Unscorable samples (``reward.exclude_unscorable``, default true).  A sample none of whose reward
sources could score it (error, timeout, None, non-finite: the reward manager's fallbacks) carries no
information about its response.  It is left out of its group's baseline (the estimators'
``sample_mask``), gets advantage 0 and is left out of the policy and value losses (``loss_mask``);
``reward/num_unscorable`` counts such samples.  The flags come from
``RewardManager.score(..., return_valid=True)`` through :class:`ValidityReward`, the reward handed to
the rollout worker: they travel in the reward metrics (the rollout worker broadcasts those to every
rank) and :func:`attach_reward_validity` moves them into each sample's ``extra``, so they follow the
samples through DAPO's dynamic sampling.

Overlong filtering (``algorithm.overlong_filter``, DAPO, Yu et al. 2025, arXiv:2503.14476, sec. 3.4):
responses the engine cut at ``data.max_response_length`` (finish reason "length") are masked out of
the losses (``actor/num_overlong_filtered``); their rewards still count in the group baselines (a
truncated response is a real, if unfinished, answer).

ReMax (Li et al. 2023, arXiv:2310.10505): the baseline of a prompt is the reward of ONE greedy response
(temperature 0) to it, scored and shaped like the sampled ones (:func:`attach_remax_baselines`); a
prompt whose greedy response is unscorable has its samples excluded as above.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rlhf import algorithms as algos

from .dynamic_sampling import overlong_shaping

__all__ = ["compute_advantages", "sample_masks", "ValidityReward", "attach_reward_validity",
           "attach_remax_baselines", "greedy_sampling", "check_sampling", "SAMPLE_VALID_KEY"]

#: reward-metrics key of the per-sample validity list (popped before the metrics are logged)
SAMPLE_VALID_KEY = "reward/_sample_valid"


def check_sampling(cfg) -> None:
    """Refuse training rollouts with ``rollout.top_p < 1`` or ``rollout.top_k > 0``.

    SGLang then samples from the top-p / top-k truncated, renormalised distribution q, but reports (and
    the trainer computes) log-probs of the full tempered softmax p.  PPO's importance ratio would use
    p_old where the samples came from q (log q = log p - log Z, Z the kept mass: ~0.36 nats/token at
    top_p=0.7) and ``actor/rollout_log_prob_diff`` could not see it.  With the check, the distribution
    the engine samples from is exactly the one both sides compute, which the diff metric compares.
    ``rollout.val_kwargs`` may truncate (validation trains nothing).

    Raises ValueError naming the setting and the fix.
    """
    r = cfg.rollout
    bad = ([f"rollout.top_p={r.top_p}"] if r.top_p < 1 else []) + ([f"rollout.top_k={r.top_k}"] if r.top_k > 0 else [])
    if bad:
        raise ValueError(
            f"{' and '.join(bad)}: SGLang would sample training responses from the top-p/top-k truncated, "
            "renormalised distribution while the engine's and the trainer's log-probs (PPO's importance ratio, "
            "actor/rollout_log_prob_diff) are those of the full softmax, so every update would use the wrong "
            "behaviour policy. Set rollout.top_p=1.0 rollout.top_k=-1 (rollout.temperature still applies; "
            "rollout.val_kwargs.top_p/top_k may stay for validation).")


def greedy_sampling(train_sampling):
    """ReMax's baseline rollout: the training SamplingConfig with one greedy response per prompt."""
    return dataclasses.replace(train_sampling, n=1, temperature=0.0, top_p=1.0, top_k=-1, seed=None)


class ValidityReward:
    """The reward handed to ``RolloutWorker.generate`` when ``reward.exclude_unscorable``: scores with
    ``manager.score(..., return_valid=True)`` (rlhf.rewards.RewardManager) and adds the per-sample
    flags (list of bool) to the metrics under SAMPLE_VALID_KEY, so every rank receives them."""

    def __init__(self, manager):
        self.manager = manager

    def score(self, *args, **kwargs):
        """Same arguments and return as ``RewardManager.score``; the metrics carry the flags."""
        scores, metrics, valid = self.manager.score(*args, return_valid=True, **kwargs)
        return scores, {**metrics, SAMPLE_VALID_KEY: [bool(v) for v in valid]}

    def close(self) -> None:
        """Close the wrapped manager."""
        self.manager.close()


def attach_reward_validity(samples, metrics: dict) -> list:
    """Pop SAMPLE_VALID_KEY from `metrics` (in place) into ``sample.extra["reward_valid"]``; returns the
    flags (all True when the metrics carry none)."""
    valid = metrics.pop(SAMPLE_VALID_KEY, None)
    valid = [True] * len(samples) if valid is None else list(valid)
    if len(valid) != len(samples):
        raise ValueError(f"reward validity has {len(valid)} flags for {len(samples)} samples")
    for s, v in zip(samples, valid):
        s.extra["reward_valid"] = bool(v)
    return valid


def attach_remax_baselines(samples, greedy: tuple, cfg) -> dict:
    """ReMax: ``greedy`` = (samples, scores, reward metrics) of one greedy response per prompt (same prompt
    batch as `samples`).  Each sample gets ``extra["reward_baseline"]`` (the greedy response's reward,
    shaped like the sampled rewards) and ``extra["baseline_valid"]``.  Returns remax/baseline_score/mean
    and reward/baseline_num_fallbacks."""
    g_samples, g_scores, g_metrics = greedy
    valid = attach_reward_validity(g_samples, dict(g_metrics))
    g_rewards, _ = overlong_shaping(g_samples, g_scores, cfg)
    by_prompt = {x.prompt_index: (r, v) for x, r, v in zip(g_samples, g_rewards, valid)}
    for s in samples:
        s.extra["reward_baseline"], s.extra["baseline_valid"] = by_prompt[s.prompt_index]
    return {"remax/baseline_score/mean": float(np.mean(g_scores)) if g_scores else 0.0,
            "reward/baseline_num_fallbacks": float(g_metrics.get("reward/num_fallbacks", 0.0))}


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
    if est == "remax":
        extra["reward_baselines"] = batch["reward_baselines"]
    batch["advantages"], batch["returns"] = algos.get_adv_estimator_fn(est)(
        token_level_rewards=batch["token_level_rewards"], response_mask=mask, index=uids, config=acfg,
        sample_mask=batch.get("sample_valid"), **extra)
    return metrics
