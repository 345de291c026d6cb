"""verl's DAPO recipes' ``algorithm.filter_groups.metric=acc``: composes, and dynamic sampling keeps a prompt group
exactly when the reward's ``acc`` (verl's reward extra info: the score function's "acc", else its score;
verl/workers/reward_manager/dapo.py) varies within it, whatever the scores do.  CPU, fast."""
from __future__ import annotations


import pytest

from rlhf.config import ConfigValidationError, compose_config, validate_config
from rlhf.rewards.manager import RewardManager, RewardSource
from rlhf.rewards.validity import ValidityReward, attach_reward_validity
from rlhf.rollout.types import RolloutSample
from rlhf.trainer import dynamic_sampling as dapo


def test_filter_groups_metric_acc_composes_and_passes_the_dapo_checks(gsm8k_row_file):
    base = [f"data.train_files={gsm8k_row_file}", "actor_rollout_ref.model.path=tiny://quickstart",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=True"]
    cfg = compose_config([*base, "algorithm.filter_groups.metric=acc"])
    assert cfg.algorithm.filter_groups.metric == "acc"
    dapo.check_config(cfg)  # raised "use one of ['score', 'seq_reward']" at the trainer's start before
    with pytest.raises(ConfigValidationError, match=r"algorithm\.filter_groups\.metric='accuracy' must be score, "
                                                    r"seq_reward or acc"):
        validate_config(compose_config([*base, "algorithm.filter_groups.metric=accuracy"]))


def _score_fn(solution_str, **_):
    """verl's DAPO math reward shape: a dict with the score and acc; here the score varies with the response's
    length while acc says whether it starts with 'yes'."""
    return {"score": float(len(solution_str)), "acc": solution_str.startswith("yes")}


RESPONSES = {0: ["yes a", "yes bb"], 1: ["yes", "no"], 2: ["no", "no"]}  # acc: equal, varies, equal


def _round(fn):
    """next_round for collect_groups: 3 prompts x 2 responses scored by a RewardManager of ``fn`` as the trainer
    hands it to the rollout (ValidityReward(acc=True)), the per-sample values moved into the samples."""
    reward = ValidityReward(RewardManager([RewardSource("custom", 1.0, fn=fn)]), valid=False, acc=True)

    def next_round(i):
        samples = [RolloutSample([1], [2], [0.0], "stop", p, k) for p in RESPONSES for k in range(2)]
        texts = [RESPONSES[x.prompt_index][x.sample_index] for x in samples]
        scores, metrics = reward.score(texts, ["custom"] * len(texts), [None] * len(texts))
        attach_reward_validity(samples, metrics)
        assert "reward/_sample_acc" not in metrics  # moved into the samples, not logged
        return samples, scores, list(scores), metrics

    return next_round


def test_group_filtering_uses_the_rewards_acc():
    """By acc only the group whose acc varies (prompt 1) is kept; by score also prompt 0 (lengths 5 and 6 differ);
    a fn returning a plain number: acc is its score (verl's managers), so acc and score filter alike."""
    by_acc = dapo.collect_groups(_round(_score_fn), target=3, max_rounds=1, metric="acc", allowed=lambda k: k)
    by_score = dapo.collect_groups(_round(_score_fn), target=3, max_rounds=1, metric="score", allowed=lambda k: k)
    assert by_acc[1] == [3.0, 2.0] and [x.extra["acc"] for x in by_acc[0]] == [1.0, 0.0]  # prompt 1 only
    assert by_score[1] == [5.0, 6.0, 3.0, 2.0]  # prompts 0 and 1
    plain = lambda solution_str, **_: float(solution_str == "yes")  # noqa: E731
    by_acc = dapo.collect_groups(_round(plain), target=3, max_rounds=1, metric="acc", allowed=lambda k: k)
    assert by_acc[1] == [1.0, 0.0] and [x.extra["acc"] for x in by_acc[0]] == [1.0, 0.0]


def test_acc_filtering_without_the_rewards_acc_is_an_error():
    def next_round(i):
        return [RolloutSample([1], [2], [0.0], "stop", 0, k) for k in range(2)], [0.0, 1.0], [0.0, 1.0], {}

    with pytest.raises(RuntimeError, match="filter_groups.metric=acc: 2 sample"):
        dapo.collect_groups(next_round, target=1, max_rounds=1, metric="acc", allowed=lambda k: k)
