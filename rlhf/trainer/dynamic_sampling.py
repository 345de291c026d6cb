"""DAPO pieces of the PPO step (Yu et al. 2025, arXiv:2503.14476): dynamic sampling and overlong
reward shaping.  Only used when enabled: ``PPOTrainer.train_step`` calls :func:`dynamic_sampling`
instead of generating one round when ``algorithm.filter_groups.enable``, and each round's rewards go
through :func:`overlong_shaping` (the scores unchanged unless ``reward.overlong_buffer.enable``).

Dynamic sampling (``algorithm.filter_groups.enable``): a prompt group whose ``rollout.n``
responses all got the same ``algorithm.filter_groups.metric`` has zero group-relative advantage,
hence no gradient; such groups are dropped and further prompt batches are generated until
``data.train_batch_size`` groups are kept or ``max_num_gen_batches`` rounds ran.  Short of the
target, the step trains on the kept groups, trimmed so that the mini-batches and the
data-parallel split still divide (see :func:`trainable_groups`).

Overlong shaping (``reward.overlong_buffer``): adds :func:`rlhf.algorithms.dapo.compute_overlong_penalty`
of the response length to each reward (the ``seq_reward`` metric; ``score`` is the raw reward).

The other DAPO ingredients are plain config: ``actor.clip_ratio_low/high`` (decoupled clip),
``actor.loss_agg_mode=token-mean``, ``algorithm.adv_estimator=grpo`` (see recipe dapo_tiny_cpu).
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Callable

import numpy as np
import torch

from rlhf.algorithms.dapo import compute_overlong_penalty, filter_groups_by_metric

#: score: raw scores; seq_reward: shaped (overlong) rewards; acc: the reward's acc (verl's reward extra info: the DAPO
#: math reward's correctness, else the score), in ``sample.extra["acc"]`` (rlhf.rewards.validity)
FILTER_METRICS = ("score", "seq_reward", "acc")

# (samples, raw scores, shaped rewards, reward metrics) of one generation round
Round = tuple[list, list, list, dict]


def check_config(cfg) -> None:
    """Raise ValueError for DAPO settings that cannot work (checked once, before any model is built)."""
    fg, ob = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer
    if fg.enable and fg.metric not in FILTER_METRICS:
        raise ValueError(f"algorithm.filter_groups.metric={fg.metric!r}: use one of {list(FILTER_METRICS)}")
    if fg.enable and cfg.rollout.n < 2:
        raise ValueError("algorithm.filter_groups.enable=true needs rollout.n >= 2 (groups of one never vary)")
    L = cfg.data.max_response_length
    if ob.enable and ob.len is not None and not 0 < ob.len <= L:
        raise ValueError(f"reward.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={L}]")


def overlong_shaping(samples, scores, cfg) -> tuple[list, dict]:
    """rewards = scores + overlong penalty of each response's length (when enabled)."""
    ob = cfg.reward.overlong_buffer
    if not ob.enable:
        return list(scores), {}
    L = cfg.data.max_response_length
    lengths = torch.tensor([len(x.response_ids) for x in samples], dtype=torch.float32)
    penalty = compute_overlong_penalty(lengths, L, ob.len or max(1, L // 4), ob.penalty_factor)
    rewards = [s + p for s, p in zip(scores, penalty.tolist())]
    return rewards, {"dapo/overlong_penalty/mean": penalty.mean().item(),
                     "dapo/overlong_frac": (penalty < 0).float().mean().item()}


def trainable_groups(num_groups: int, target: int, n: int, mini_batch_groups: list[int], dp_size: int) -> int:
    """How many of `num_groups` kept groups (of `n` sequences) one step can train on.

    The full `target` when reached; else the largest multiple of every mini batch size
    (in groups) that fits; below one mini batch (a single mini batch then), the largest count
    whose sequences split evenly over `dp_size` data-parallel ranks.  0 when none fits.
    """
    if num_groups >= target:
        return target
    unit = math.lcm(*mini_batch_groups) if mini_batch_groups else 1
    if num_groups >= unit:
        return num_groups // unit * unit
    for k in range(min(num_groups, unit - 1), 0, -1):
        if (k * n) % dp_size == 0:
            return k
    return 0


def _acc(samples) -> list:
    """Each sample's reward ``acc`` (``sample.extra["acc"]``).

    Raises:
        RuntimeError: a sample without it (the reward was not asked for it).
    """
    missing = [i for i, x in enumerate(samples) if "acc" not in x.extra]
    if missing:
        raise RuntimeError(f"algorithm.filter_groups.metric=acc: {len(missing)} sample(s) carry no reward acc "
                           f"(the reward must be wrapped by rlhf.rewards.validity.ValidityReward(acc=True))")
    return [x.extra["acc"] for x in samples]


def collect_groups(next_round: Callable[[int], Round], *, target: int, max_rounds: int, metric: str,
                   allowed: Callable[[int], int]) -> Round:
    """Dynamic-sampling loop.  `next_round(i)` draws a new prompt batch, generates and scores it
    (samples carry `prompt_index` within their round).  Groups whose `metric` ("score": raw
    scores, "seq_reward": shaped rewards, "acc": the reward's acc in ``sample.extra``) varies are kept, until
    `target` groups or `max_rounds` rounds (<= 0: no cap); then `allowed(kept)` groups are used (the first
    ones).  If that is 0, the last round is used unfiltered.  Returned samples get `prompt_index` = group number in the
    batch (a unique uid per group across rounds).  Metrics add dapo/num_gen_batches and
    dapo/kept_groups (groups trained on), dapo/filtered_groups (varied groups found)."""
    groups: list = []  # (samples, scores, rewards) per kept group
    sums: dict = defaultdict(float)
    rounds = 0
    while True:
        samples, scores, rewards, rm = next_round(rounds)
        rounds += 1
        for k, v in rm.items():
            sums[k] += v
        values = scores if metric == "score" else rewards if metric == "seq_reward" else _acc(samples)
        uids = np.array([x.prompt_index for x in samples])
        keep = filter_groups_by_metric(values, uids, keep_singleton_groups=False).tolist()
        by_uid: dict = {}
        for i, x in enumerate(samples):
            if keep[i]:
                by_uid.setdefault(x.prompt_index, []).append(i)
        groups += [([samples[i] for i in idx], [scores[i] for i in idx], [rewards[i] for i in idx])
                   for idx in by_uid.values()]
        if len(groups) >= target or (max_rounds > 0 and rounds >= max_rounds):
            break
    found = len(groups)
    use = allowed(min(found, target))
    if use == 0:  # nothing trainable: fall back to the last round as generated
        uid_order = list(dict.fromkeys(x.prompt_index for x in samples))
        groups = [([samples[i] for i in idx], [scores[i] for i in idx], [rewards[i] for i in idx])
                  for idx in ([i for i, x in enumerate(samples) if x.prompt_index == u] for u in uid_order)]
        use = len(groups)
    out_samples, out_scores, out_rewards = [], [], []
    for g, (gs, gsc, grw) in enumerate(groups[:use]):
        out_samples += [dataclasses.replace(x, prompt_index=g) for x in gs]
        out_scores += gsc
        out_rewards += grw
    # counts and seconds add up over the rounds (timing_s/reward: every round's scoring); the rest is a mean
    metrics = {k: (v if k.endswith("num_fallbacks") or k.startswith("timing_s/") else v / rounds)
               for k, v in sums.items()}
    metrics.update({"dapo/num_gen_batches": float(rounds), "dapo/kept_groups": float(use if found else 0),
                    "dapo/filtered_groups": float(found)})
    return out_samples, out_scores, out_rewards, metrics


def dynamic_sampling(next_round: Callable[[int], Round], cfg, *, dp_size: int, has_critic: bool) -> Round:
    """The step's rollouts under ``algorithm.filter_groups``: :func:`collect_groups` until
    ``data.train_batch_size`` varied groups (or ``max_num_gen_batches`` rounds), trimmed by
    :func:`trainable_groups` to what the actor's (and the critic's) mini batches and `dp_size`
    data-parallel ranks can split.  `next_round(i)` draws, generates, scores and shapes round i."""
    fg = cfg.algorithm.filter_groups
    minis = [cfg.actor.ppo_mini_batch_size] + ([cfg.critic.ppo_mini_batch_size] if has_critic else [])
    target = cfg.data.train_batch_size
    return collect_groups(next_round, target=target, max_rounds=fg.max_num_gen_batches, metric=fg.metric,
                          allowed=lambda k: trainable_groups(k, target, cfg.rollout.n, minis, dp_size))
