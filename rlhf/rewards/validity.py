"""Reward validity: which samples the reward could score, carried from the reward manager to the samples.

A sample none of whose reward sources could score it (error, timeout, None, non-finite: the reward
manager's fallbacks) carries no information about its response; with ``reward.exclude_unscorable`` the
trainer leaves it out of the baselines and the losses (rlhf.trainer.advantages.sample_masks).  The flags
come from ``RewardManager.score(..., return_valid=True)`` through :class:`ValidityReward`, the reward
handed to the rollout worker: they travel in the reward metrics (the rollout worker broadcasts those to
every rank) and :func:`attach_reward_validity` moves them into each sample's ``extra``, so they follow the
samples through DAPO's dynamic sampling.
"""
from __future__ import annotations

__all__ = ["SAMPLE_VALID_KEY", "SAMPLE_ACC_KEY", "ValidityReward", "attach_reward_validity"]

#: reward-metrics key of the per-sample validity list (popped before the metrics are logged)
SAMPLE_VALID_KEY = "reward/_sample_valid"
#: reward-metrics key of the per-sample ``acc`` list (verl's reward extra info; RewardManager.score(return_acc=True))
SAMPLE_ACC_KEY = "reward/_sample_acc"


class ValidityReward:
    """The reward handed to ``RolloutWorker.generate`` when ``reward.exclude_unscorable`` (``valid``) or DAPO
    filters groups by ``acc`` (``acc``): scores with ``manager.score(..., return_valid=True, return_acc=acc)``
    (rlhf.rewards.RewardManager) and adds the per-sample flags (list of bool) under SAMPLE_VALID_KEY, the manager
    its ``acc`` list under SAMPLE_ACC_KEY, so every rank receives them."""

    def __init__(self, manager, valid: bool = True, acc: bool = False):
        self.manager, self.valid, self.acc = manager, valid, acc

    def score(self, *args, **kwargs):
        """Same arguments and return as ``RewardManager.score``; the metrics carry the flags."""
        scores, metrics, valid = self.manager.score(*args, return_valid=True, return_acc=self.acc, **kwargs)
        return scores, {**metrics, **({SAMPLE_VALID_KEY: [bool(v) for v in valid]} if self.valid else {})}

    def close(self) -> None:
        """Close the wrapped manager."""
        self.manager.close()


def attach_reward_validity(samples, metrics: dict) -> list:
    """Pop SAMPLE_VALID_KEY from `metrics` (in place) into ``sample.extra["reward_valid"]`` (and SAMPLE_ACC_KEY,
    when there, into ``sample.extra["acc"]``); returns the flags (all True when the metrics carry none)."""
    acc = metrics.pop(SAMPLE_ACC_KEY, None)
    for s, a in zip(samples, acc if acc is not None and len(acc) == len(samples) else ()):
        s.extra["acc"] = float(a)
    valid = metrics.pop(SAMPLE_VALID_KEY, None)
    valid = [True] * len(samples) if valid is None else list(valid)
    if len(valid) != len(samples):
        raise ValueError(f"reward validity has {len(valid)} flags for {len(samples)} samples")
    for s, v in zip(samples, valid):
        s.extra["reward_valid"] = bool(v)
    return valid
