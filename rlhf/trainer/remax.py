"""ReMax in the trainer (Li et al. 2023, arXiv:2310.10505): the baseline of a prompt is the reward of ONE
greedy response (temperature 0) to it, scored and shaped like the sampled ones; the estimator is
rlhf.algorithms.estimators.remax.  A prompt whose greedy response is unscorable has its samples excluded
(``reward.exclude_unscorable``, rlhf.trainer.advantages.sample_masks).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from rlhf.rewards.validity import attach_reward_validity

from .dynamic_sampling import overlong_shaping

__all__ = ["greedy_sampling", "attach_remax_baselines"]


def greedy_sampling(train_sampling):
    """ReMax's baseline rollout: the training SamplingConfig with one greedy response per prompt."""
    return dataclasses.replace(train_sampling, n=1, temperature=0.0, top_p=1.0, top_k=-1, seed=None)


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
