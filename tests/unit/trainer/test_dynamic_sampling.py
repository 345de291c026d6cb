"""DAPO in the trainer (rlhf/trainer/dynamic_sampling.py): dynamic-sampling loop with a fake generator
(fills the batch, stops at its cap, trims to what the mini-batches / DP split allow), overlong shaping
values, config checks, and the group uids the estimators see; PPOTrainer.generate_round (one prompt
batch, the step's seed, shaped rewards) with a fake rollout.  CPU only, fast."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf.algorithms import compute_grpo_outcome_advantage
from rlhf.rollout.types import RolloutSample
from rlhf.trainer import dynamic_sampling as dapo
from rlhf.trainer.ppo_trainer import PPOTrainer
from rlhf.workers.batch import outcome_token_scores
from tests.support.fakes import FakePromptLoader, FakeRollout


def sample(prompt: int, k: int, length: int = 3) -> RolloutSample:
    return RolloutSample([7, prompt], [5] * length, [0.0] * length, "stop", prompt, k)


def fake_rounds(score_table, n=2, fallbacks=0):
    """next_round(i) -> one round of len(score_table[i]) prompts x n samples; score_table[i][p] is
    either one score for all n samples (an all-equal group) or a list of n scores."""
    calls = []

    def next_round(i):
        calls.append(i)
        samples, scores = [], []
        for p, sc in enumerate(score_table[i]):
            per = sc if isinstance(sc, list) else [sc] * n
            for k in range(n):
                samples.append(sample(p, k))
                scores.append(float(per[k]))
        return samples, scores, list(scores), {"reward/num_fallbacks": float(fallbacks), "reward/rule/mean": 0.5}

    return next_round, calls


def test_fills_batch_then_stops():
    # 4 prompts per round; rounds 0 and 1 have 2 and 3 varied groups -> target 4 reached in round 1
    table = [[1, [0, 1], 0, [1, 0]], [[0, 1], 1, [1, 0], [0, 1]], [[0, 1]] * 4]
    next_round, calls = fake_rounds(table)
    samples, scores, rewards, m = dapo.collect_groups(next_round, target=4, max_rounds=10, metric="score",
                                                      allowed=lambda k: k)
    assert calls == [0, 1]
    assert m["dapo/num_gen_batches"] == 2 and m["dapo/kept_groups"] == 4 and m["dapo/filtered_groups"] == 5
    assert len(samples) == 8  # trimmed to the target: 4 groups x n=2
    # groups renumbered 0..3 across rounds (unique uid per group), each group's samples together
    assert [x.prompt_index for x in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert scores == [0, 1, 1, 0, 0, 1, 1, 0]
    # fallbacks are summed over rounds, other reward metrics averaged
    assert m["reward/num_fallbacks"] == 0 and m["reward/rule/mean"] == 0.5


def test_stops_at_cap_and_trims_to_trainable():
    table = [[1, [0, 1], 1]] * 5  # one varied group per round
    next_round, calls = fake_rounds(table, fallbacks=1)
    allowed = lambda k: dapo.trainable_groups(k, target=8, n=2, mini_batch_groups=[2], dp_size=1)
    samples, scores, _, m = dapo.collect_groups(next_round, target=8, max_rounds=3, metric="score", allowed=allowed)
    assert calls == [0, 1, 2]  # the cap
    assert m["dapo/num_gen_batches"] == 3 and m["dapo/filtered_groups"] == 3
    assert m["dapo/kept_groups"] == 2 and len(samples) == 4  # 3 groups -> a multiple of the mini batch (2)
    assert m["reward/num_fallbacks"] == 3
    groups = {}
    for x, s in zip(samples, scores):
        groups.setdefault(x.prompt_index, []).append(s)
    assert all(sorted(v) == [0.0, 1.0] for v in groups.values())


def test_no_cap_keeps_generating():
    table = [[0, 0]] * 6 + [[[0, 1], [1, 0]]]
    next_round, calls = fake_rounds(table)
    _, _, _, m = dapo.collect_groups(next_round, target=2, max_rounds=0, metric="score", allowed=lambda k: k)
    assert calls == list(range(7)) and m["dapo/kept_groups"] == 2


def test_nothing_varied_falls_back_to_last_round():
    next_round, calls = fake_rounds([[1, 0, 1]] * 2)
    samples, scores, _, m = dapo.collect_groups(next_round, target=3, max_rounds=2, metric="score",
                                                allowed=lambda k: k)
    assert calls == [0, 1] and m["dapo/kept_groups"] == 0 and m["dapo/filtered_groups"] == 0
    assert [x.prompt_index for x in samples] == [0, 0, 1, 1, 2, 2] and scores == [1, 1, 0, 0, 1, 1]


def test_seq_reward_metric_filters_on_shaped_rewards():
    def next_round(i):
        samples = [sample(0, 0), sample(0, 1), sample(1, 0), sample(1, 1)]
        scores = [1.0, 1.0, 1.0, 0.0]
        rewards = [1.0, 0.5, 1.0, 1.0]  # shaping makes group 0 vary and group 1 equal
        return samples, scores, rewards, {}

    by_score = dapo.collect_groups(next_round, target=1, max_rounds=1, metric="score", allowed=lambda k: k)
    by_reward = dapo.collect_groups(next_round, target=1, max_rounds=1, metric="seq_reward", allowed=lambda k: k)
    assert by_score[1] == [1.0, 0.0] and by_reward[1] == [1.0, 1.0] and by_reward[2] == [1.0, 0.5]


@pytest.mark.parametrize("found,target,n,minis,dp,expected", [
    (9, 8, 4, [2], 1, 8),        # target reached
    (5, 8, 2, [2], 1, 4),        # multiple of the mini batch
    (7, 16, 2, [2, 4], 2, 4),    # multiple of both actor and critic mini batches
    (3, 8, 2, [4], 2, 3),        # below one mini batch: whole DP split (3 x 2 seqs over 2 ranks)
    (3, 8, 1, [4], 2, 2),        # ... 3 x 1 does not split over 2 ranks, 2 does
    (1, 8, 1, [4], 2, 0),        # nothing fits
    (0, 8, 2, [2], 1, 0),
])
def test_trainable_groups(found, target, n, minis, dp, expected):
    assert dapo.trainable_groups(found, target, n, minis, dp) == expected


def _cfg(enable=True, length=None, factor=1.0, max_len=16, metric="score", fg=False, n=4):
    return SimpleNamespace(
        data=SimpleNamespace(max_response_length=max_len, train_batch_size=4),
        reward=SimpleNamespace(overlong_buffer=SimpleNamespace(enable=enable, len=length, penalty_factor=factor)),
        algorithm=SimpleNamespace(adv_estimator="grpo",
                                  filter_groups=SimpleNamespace(enable=fg, metric=metric, max_num_gen_batches=3)),
        rollout=SimpleNamespace(n=n), trainer=SimpleNamespace(seed=1))


def test_overlong_shaping_values():
    samples = [sample(0, 0, length) for length in (10, 12, 13, 14, 16)]
    scores = [1.0, 1.0, 0.0, 1.0, 1.0]
    rewards, m = dapo.overlong_shaping(samples, scores, _cfg(length=4, factor=1.0))
    # L_max 16, buffer 4: <= 12 free, 13 -> -0.25, 14 -> -0.5, 16 -> -1
    assert rewards == pytest.approx([1.0, 1.0, -0.25, 0.5, 0.0])
    assert m["dapo/overlong_penalty/mean"] == pytest.approx(-(0.25 + 0.5 + 1.0) / 5)
    assert m["dapo/overlong_frac"] == pytest.approx(3 / 5)
    # default buffer: a quarter of max_response_length; factor scales
    rewards, _ = dapo.overlong_shaping(samples, scores, _cfg(length=None, factor=0.5))
    assert rewards == pytest.approx([1.0, 1.0, -0.125, 0.75, 0.5])
    assert dapo.overlong_shaping(samples, scores, _cfg(enable=False)) == (scores, {})


def test_check_config():
    dapo.check_config(_cfg(fg=True, length=4))
    with pytest.raises(ValueError, match="metric"):
        dapo.check_config(_cfg(fg=True, metric="accuracy"))  # acc is verl's (tests/unit/trainer/test_dapo_acc.py)
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        dapo.check_config(_cfg(fg=True, n=1))
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        dapo.check_config(_cfg(length=17))


def test_generate_round_uids_seed_and_shaping():
    """Plain PPO (no dynamic sampling): one prompt batch per round, the rollout seed of the step and
    round, shaped rewards, and prompt_index as the group uid (n samples of a prompt share it, GRPO
    normalises within it)."""
    n = 3
    samples = [sample(p, k, length=4 + p) for p in range(2) for k in range(n)]
    rollout = FakeRollout([(samples, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], {"reward/num_fallbacks": 0.0})] * 2)
    trainer = SimpleNamespace(cfg=_cfg(length=4, max_len=8, n=n), train_loader=FakePromptLoader(["b0", "b1"]),
                              rollout=rollout, reward="the-reward")
    got, scores, rewards, m = PPOTrainer.generate_round(trainer, 5, 0)
    assert rollout.calls == [("b0", "train", "the-reward", 1 * 100_003 + 5 * 1009)]
    assert got == samples and scores == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert rewards == pytest.approx([1.0, 0.0, 0.0, 0.75, 0.75, 0.75])  # length 5 -> -0.25 (buffer 4 of 8)
    assert m["reward/num_fallbacks"] == 0.0 and m["dapo/overlong_frac"] == pytest.approx(0.5)
    uids = np.array([x.prompt_index for x in got])
    mask = torch.ones(6, 5, dtype=torch.long)
    adv, _ = compute_grpo_outcome_advantage(outcome_token_scores(rewards, mask), mask, uids)
    assert torch.allclose(adv[:, 0], torch.tensor([2, -1, -1, 0, 0, 0]) / torch.tensor(3.0).sqrt(), atol=1e-4)
    PPOTrainer.generate_round(trainer, 5, 2)  # the next round of the same step draws the next batch, its own seed
    assert rollout.calls[-1] == ("b1", "train", "the-reward", 1 * 100_003 + 5 * 1009 + 2 * 7)


def test_dynamic_sampling_trims_to_actor_and_critic_mini_batches():
    table = [[[0, 1], [1, 0], [0, 1], 1]] * 3  # 3 varied groups per round
    cfg = _cfg(fg=True, n=2)
    cfg.data.train_batch_size = 16
    cfg.algorithm.filter_groups.max_num_gen_batches = 2
    cfg.actor, cfg.critic = SimpleNamespace(ppo_mini_batch_size=2), SimpleNamespace(ppo_mini_batch_size=4)
    next_round, calls = fake_rounds(table)
    samples, _, _, m = dapo.dynamic_sampling(next_round, cfg, dp_size=1, has_critic=False)
    assert calls == [0, 1] and m["dapo/filtered_groups"] == 6 and m["dapo/kept_groups"] == 6  # multiple of 2
    next_round, calls = fake_rounds(table)
    samples, _, _, m = dapo.dynamic_sampling(next_round, cfg, dp_size=1, has_critic=True)
    assert m["dapo/kept_groups"] == 4 and len(samples) == 8  # multiple of lcm(2, 4)
