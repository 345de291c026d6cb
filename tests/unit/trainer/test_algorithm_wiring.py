"""The algorithms wired into the PPO trainer, CPU only, fast, hand-computed values:

* compute_advantages calls every estimator through the registry with verl's keywords (config=, index=,
  sample_mask=, values= for GAE, reward_baselines= for ReMax);
* unscorable samples: RewardManager.score(return_valid=True) -> ValidityReward -> sample.extra ->
  batch["sample_valid"] / batch["loss_mask"], counted in reward/num_unscorable;
* ReMax's greedy baseline per prompt; algorithm.overlong_filter from the finish reason;
* the adaptive KL controller built from algorithm.kl_ctrl and fed the sequence KL;
* top-p / top-k training rollouts refused.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf import algorithms as algos
from rlhf.config import compose_config
from rlhf.rewards.manager import RewardManager, RewardSource
from rlhf.rewards.validity import SAMPLE_VALID_KEY, ValidityReward, attach_reward_validity
from rlhf.rollout.sampling import SamplingConfig, check_sampling
from rlhf.rollout.types import RolloutSample
from rlhf.trainer.advantages import compute_advantages, sample_masks
from rlhf.trainer.remax import attach_remax_baselines, greedy_sampling
from rlhf.workers.batch import build_rollout_batch, outcome_token_scores


def _samples(lengths, finish=None, n=2):
    finish = finish or ["stop"] * len(lengths)
    return [RolloutSample([7], [5] * L, [-0.5] * L, f, i // n, i % n) for i, (L, f) in enumerate(zip(lengths, finish))]


def _cfg(est="grpo", exclude=True, overlong=False, **algo):
    return compose_config([f"algorithm.adv_estimator={est}", f"reward.exclude_unscorable={exclude}",
                           f"algorithm.overlong_filter={overlong}"] + [f"algorithm.{k}={v}" for k, v in algo.items()])


def _batch(samples, scores, cfg, R=4):
    batch = build_rollout_batch(samples, 0, R)
    batch["token_level_scores"] = outcome_token_scores(scores, batch["response_mask"])
    m = sample_masks(batch, samples, cfg)
    return batch, m


# ---- unscorable samples --------------------------------------------------------------------------
def _rule(values):
    """A reward fn returning values[response] (raising for "raise")."""
    def fn(solution_str, ground_truth):
        v = values[solution_str]
        if v == "raise":
            raise RuntimeError("reward service down")
        return v
    return fn


def test_reward_manager_return_valid_flags_every_failure_kind():
    """A sample is unscorable when NO source scored it: an exception, None, +inf (non-finite) all count; one
    good source among two keeps the sample valid.  Non-finite numbers become fallback_score and are counted."""
    responses = ["ok", "raise", "none", "inf", "half"]
    a = _rule({"ok": 1.0, "raise": "raise", "none": None, "inf": float("inf"), "half": "raise"})
    b = _rule({"ok": 0.0, "raise": "raise", "none": None, "inf": float("-inf"), "half": 2.0})
    mgr = RewardManager([RewardSource("a", 1.0, fn=a), RewardSource("b", 0.5, fn=b)], fallback_score=-1.0)
    ds, gt = ["x"] * 5, [None] * 5
    scores, metrics, valid = mgr.score(responses, ds, gt, return_valid=True)
    assert valid == [True, False, False, False, True]
    # ok: 1 + 0.5 * 0; failures: -1 + 0.5 * -1; half: -1 (a failed) + 0.5 * 2
    assert scores == pytest.approx([1.0, -1.5, -1.5, -1.5, 0.0])
    assert metrics["reward/a/num_fallbacks"] == 4 and metrics["reward/b/num_fallbacks"] == 3
    assert metrics["reward/num_fallbacks"] == 7
    plain_scores, plain_metrics = mgr.score(responses[:2], ds[:2], gt[:2])  # the default: two items, as before
    assert plain_scores == pytest.approx([1.0, -1.5]) and plain_metrics["reward/num_fallbacks"] == 2
    # the adapter the trainer hands to the rollout worker carries the flags in the metrics
    wrapped = ValidityReward(mgr)
    s2, m2 = wrapped.score(responses, ds, gt)
    assert s2 == scores and m2[SAMPLE_VALID_KEY] == valid and m2["reward/num_fallbacks"] == 7


def test_unscorable_samples_leave_the_baseline_and_the_loss():
    """GRPO group [1, 0, fallback 0 (unscorable)]: the baseline is over the two valid samples, mean 0.5, std
    sqrt(0.5) (unbiased), so A = +-0.5 / (0.70711 + 1e-6) = +-0.70711; the unscorable sample gets A = 0 and a
    zero loss-mask row; reward/num_unscorable = 1.  With exclude_unscorable=false the fallback 0 counts:
    mean 1/3, std 0.57735 -> A = [1.1547, -0.57735, -0.57735]."""
    samples = _samples([2, 3, 1, 2, 2, 2], n=3)
    metrics = {"reward/num_fallbacks": 1.0, SAMPLE_VALID_KEY: [True, True, False, True, True, True]}
    attach_reward_validity(samples, metrics)
    assert SAMPLE_VALID_KEY not in metrics and [s.extra["reward_valid"] for s in samples][2] is False
    scores = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    batch, m = _batch(samples, scores, _cfg("grpo"))
    assert m == {"reward/num_unscorable": 1.0}
    assert batch["sample_valid"].tolist() == [True, True, False, True, True, True]
    assert batch["loss_mask"].tolist()[2] == [0, 0, 0, 0] and batch["loss_mask"].tolist()[1] == [1, 1, 1, 0]
    compute_advantages(batch, np.array([s.prompt_index for s in samples]), _cfg("grpo").algorithm,
                       algos.get_kl_controller(_cfg("grpo").algorithm.kl_ctrl))
    assert batch["advantages"][:3, 0].tolist() == pytest.approx([0.70711, -0.70711, 0.0], abs=1e-4)
    assert batch["advantages"][3:].abs().max() == 0  # a constant group: exactly 0
    cfg = _cfg("grpo", exclude=False)
    batch, m = _batch(samples, scores, cfg)
    assert m == {"reward/num_unscorable": 0.0} and bool(batch["sample_valid"].all())
    compute_advantages(batch, np.array([s.prompt_index for s in samples]), cfg.algorithm, None)
    assert batch["advantages"][:3, 0].tolist() == pytest.approx([1.1547, -0.57735, -0.57735], abs=1e-4)


def test_a_sample_whose_rollout_failed_leaves_the_baseline_and_the_loss():
    """A sample still failed after its greedy retry (extra["rollout_failed"], rlhf.rollout.fallback) is not a
    response of the policy: GRPO group [1, 0, failed] -> A = +-0.70711 and 0 (as an unscorable sample), a zero
    loss-mask row, whatever reward.exclude_unscorable says; it is not counted as unscorable."""
    samples = _samples([2, 3, 1, 2, 2, 2], n=3)
    samples[2].extra["rollout_failed"] = True
    for cfg in (_cfg("grpo"), _cfg("grpo", exclude=False)):
        batch, m = _batch(samples, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], cfg)
        assert m == {"reward/num_unscorable": 0.0}
        assert batch["sample_valid"].tolist() == [True, True, False, True, True, True]
        assert batch["loss_mask"].tolist()[2] == [0, 0, 0, 0]
        compute_advantages(batch, np.array([s.prompt_index for s in samples]), cfg.algorithm, None)
        assert batch["advantages"][:3, 0].tolist() == pytest.approx([0.70711, -0.70711, 0.0], abs=1e-4)


def test_overlong_filter_masks_truncated_responses_out_of_the_loss_only():
    """finish_reason "length" survives into batch["truncated"]; with algorithm.overlong_filter those rows of
    loss_mask are 0 (counted in actor/num_overlong_filtered) while their rewards still form the baseline."""
    samples = _samples([4, 2, 4, 1], finish=["length", "stop", "length", "stop"])
    cfg = _cfg("grpo", overlong=True)
    batch, m = _batch(samples, [0.0, 1.0, 0.0, 1.0], cfg)
    assert batch["truncated"].tolist() == [True, False, True, False]
    assert m == {"reward/num_unscorable": 0.0, "actor/num_overlong_filtered": 2.0}
    assert batch["loss_mask"].sum(1).tolist() == [0, 2, 0, 1]
    compute_advantages(batch, np.array([0, 0, 1, 1]), cfg.algorithm, None)
    # groups [0, 1]: A = -+0.5 / (0.70711 + 1e-6); the truncated response keeps its (negative) advantage
    assert batch["advantages"][:, 0].tolist() == pytest.approx([-0.70711, 0.70711, -0.70711, 0.70711], abs=1e-4)
    batch, m = _batch(samples, [0.0, 1.0, 0.0, 1.0], _cfg("grpo"))  # off: the loss mask is the response mask
    assert "actor/num_overlong_filtered" not in m and torch.equal(batch["loss_mask"], batch["response_mask"])


# ---- ReMax -----------------------------------------------------------------------------------------
def test_remax_greedy_baseline_per_prompt():
    """Two prompts x n=2.  Greedy responses score 0.5 (prompt 0) and unscorable (prompt 1).  A_t = R - b on
    every response token: prompt 0: [1 - 0.5, 0 - 0.5]; prompt 1's samples are excluded (baseline unknown)."""
    samples = _samples([2, 3, 2, 2])
    greedy = ([RolloutSample([7], [5], [0.0], "stop", p, 0) for p in (1, 0)], [0.0, 0.5],
              {"reward/num_fallbacks": 1.0, SAMPLE_VALID_KEY: [False, True]})
    cfg = _cfg("remax")
    m = attach_remax_baselines(samples, greedy, cfg)
    assert m == {"remax/baseline_score/mean": 0.25, "reward/baseline_num_fallbacks": 1.0}
    assert [s.extra["reward_baseline"] for s in samples] == [0.5, 0.5, 0.0, 0.0]
    batch, bm = _batch(samples, [1.0, 0.0, 1.0, 1.0], cfg)
    assert bm["reward/num_unscorable"] == 2.0 and batch["reward_baselines"].tolist() == [0.5, 0.5, 0.0, 0.0]
    compute_advantages(batch, np.array([0, 0, 1, 1]), cfg.algorithm, None)
    assert batch["advantages"].tolist() == [[0.5, 0.5, 0, 0], [-0.5, -0.5, -0.5, 0], [0] * 4, [0] * 4]
    train = SamplingConfig(n=4, temperature=0.7, max_new_tokens=9, stop_token_ids=[2], seed=3)
    g = greedy_sampling(train)
    assert (g.n, g.temperature, g.seed, g.max_new_tokens, g.stop_token_ids) == (1, 0.0, None, 9, [2])


# ---- every estimator through the registry -----------------------------------------------------------
ESTIMATORS = ["gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk"]


@pytest.mark.parametrize("est", ESTIMATORS)
def test_compute_advantages_reaches_every_estimator_with_its_config(est):
    """compute_advantages = the registered estimator called with explicit arguments from the config (gamma,
    lam, norm_adv_by_std_in_grpo), the uids, the validity mask and (gae) values / (remax) baselines."""
    assert sorted(ESTIMATORS) == sorted(algos.ADV_ESTIMATOR_REGISTRY)
    g = torch.Generator().manual_seed(1)
    samples = _samples([2, 3, 4, 1, 2, 4, 3, 3], n=4)
    scores = torch.rand(8, generator=g).tolist()
    extra = {"gamma": 0.9, "lam": 0.8} if est in ("gae", "reinforce_plus_plus") else {}
    if est in ("grpo", "grpo_passk"):
        extra["norm_adv_by_std_in_grpo"] = False
    cfg = _cfg(est, **extra)
    attach_reward_validity(samples, {SAMPLE_VALID_KEY: [True] * 7 + [False]})
    for s in samples:
        s.extra.update(reward_baseline=0.25, baseline_valid=True)
    batch, _ = _batch(samples, scores, cfg)
    uids = np.array([s.prompt_index for s in samples])
    if est == "gae":
        batch["values"] = torch.rand(8, 4, generator=g) * batch["response_mask"]
    compute_advantages(batch, uids, cfg.algorithm, None)
    rewards, mask, valid = batch["token_level_scores"], batch["response_mask"], batch["sample_valid"]
    fn = algos.get_adv_estimator_fn(est)
    if est == "gae":
        want = fn(rewards, batch["values"], mask, gamma=0.9, lam=0.8, sample_mask=valid)
    elif est == "reinforce_plus_plus":
        want = fn(rewards, mask, gamma=0.9, sample_mask=valid)
    elif est == "remax":
        want = fn(rewards, torch.full((8,), 0.25), mask, sample_mask=valid)
    elif est in ("grpo", "grpo_passk"):
        want = fn(rewards, mask, uids, norm_adv_by_std_in_grpo=False, sample_mask=valid)
    else:
        want = fn(rewards, mask, uids, sample_mask=valid)
    torch.testing.assert_close(batch["advantages"], want[0])
    torch.testing.assert_close(batch["returns"], want[1])
    assert batch["advantages"][7].abs().sum() == 0  # the unscorable sample
    if est == "remax":  # hand value: sample 0 scored scores[0], baseline 0.25, on both of its tokens
        assert batch["advantages"][0, :2].tolist() == pytest.approx([scores[0] - 0.25] * 2)


def test_adaptive_kl_controller_from_config_sees_the_sequence_kl():
    """algorithm.kl_ctrl builds the controller (verl: get_kl_controller(config.algorithm.kl_ctrl)).  Two
    responses of 4 tokens at k1 KL 0.05 nats/token: token-mean 0.05 (below target 0.1), sequence KL 0.2
    (above): beta grows by 1 + clip(0.2/0.1 - 1, -0.2, 0.2) * 2 / 10 = 1.04."""
    cfg = compose_config(["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                          "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.kl_ctrl.target_kl=0.1",
                          "algorithm.kl_ctrl.horizon=10", "algorithm.adv_estimator=reinforce_plus_plus"])
    ctrl = algos.get_kl_controller(cfg.algorithm.kl_ctrl)
    mask = torch.ones(2, 4)
    batch = {"response_mask": mask, "token_level_scores": torch.zeros(2, 4),
             "old_log_probs": torch.full((2, 4), -1.0), "ref_log_probs": torch.full((2, 4), -1.05)}
    m = compute_advantages(batch, np.array([0, 1]), cfg.algorithm, ctrl)
    assert ctrl.value == pytest.approx(0.5 * 1.04)
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.05)
    assert m["actor/reward_kl_penalty_seq"] == pytest.approx(0.2)
    assert batch["token_level_rewards"][0].tolist() == pytest.approx([-0.025] * 4)  # 0 - 0.5 * 0.05


# ---- top-p / top-k training rollouts ------------------------------------------------------------
@pytest.mark.parametrize("overrides,bad", [
    (["rollout.top_p=0.7"], "rollout.top_p=0.7"), (["rollout.top_k=20"], "rollout.top_k=20"),
    (["rollout.top_p=0.9", "rollout.top_k=5"], "rollout.top_p=0.9 and rollout.top_k=5")])
def test_truncated_sampling_refused_for_training(overrides, bad):
    """SGLang samples from the renormalised top-p/top-k distribution but reports full-softmax log-probs: for
    p = softmax = [0.5, 0.3, 0.2] and top_p = 0.7 the kept mass is Z = 0.8, so every sampled token's true
    log-prob is log p - log 0.8 = log p + 0.223 nats, a gap neither side sees.  Refused with the fix; the
    validation sampling may truncate."""
    with pytest.raises(ValueError, match=rf"^{bad}: SGLang .* Set rollout.top_p=1.0 rollout.top_k=-1"):
        check_sampling(compose_config(overrides))
    check_sampling(compose_config(["rollout.val_kwargs.top_p=0.7", "rollout.val_kwargs.top_k=20"]))
