"""What every advantage estimator shares (rlhf/algorithms/estimators/): verl's keyword call with ``config=``,
``sample_mask`` (unscorable samples left out of the group baseline), padding never leaking, and the
numerical-safety rules: constant groups give EXACTLY zero advantage, non-finite rewards are refused.

Expected numbers are worked out in the docstrings / comments, never by the function under test.
"""

import pytest
import torch

from rlhf.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from tests.unit.algorithms.helpers import INF, NAN, outcome, outcome_rewards, per_sample, t


GROUP_ESTIMATORS = [
    compute_grpo_outcome_advantage, compute_grpo_vectorized_outcome_advantage, compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage, compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_opo_outcome_advantage, compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage,
]


# ----------------------------------------------------------------- critic-free estimators: edge cases

OUTCOME_ESTIMATORS = [compute_grpo_outcome_advantage, compute_rloo_outcome_advantage,
                    compute_reinforce_plus_plus_baseline_outcome_advantage]


def test_every_registered_estimator_takes_verls_keyword_call():
    """verl's trainer calls every estimator but GAE/GRPO as fn(token_level_rewards=, response_mask=,
    config=, index=, [reward_baselines=]); gamma, lam and the std flag come from config."""
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0], [1, 2, 2, 1], width=2)
    config = {"gamma": 0.5, "lam": 1.0, "norm_adv_by_std_in_grpo": False}
    for name, fn in sorted(ADV_ESTIMATOR_REGISTRY.items()):
        kwargs = dict(token_level_rewards=rewards, response_mask=mask, config=config, index=[0, 0, 1, 1])
        if name == "remax":
            kwargs["reward_baselines"] = t([0.5, 0.5, 0.5, 0.5])
        if name == "gae":
            kwargs["values"] = torch.zeros_like(mask)
        adv, ret = fn(**kwargs)
        assert adv.shape == mask.shape and torch.isfinite(adv).all(), name
    # config.norm_adv_by_std_in_grpo=False -> Dr.GRPO: R - mean = [0.5, -0.5, -0.5, 0.5]
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0, 1, 1], config=config)
    assert per_sample(adv) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # REINFORCE++ reads gamma = 0.5 from config: row [0, 1] -> returns [0.5, 1]
    _, ret = compute_reinforce_plus_plus_outcome_advantage(t([[0.0, 1.0]]), t([[1, 1]]), config=config)
    torch.testing.assert_close(ret, t([[0.5, 1.0]]))
    with pytest.raises(ValueError, match="gamma"):
        compute_reinforce_plus_plus_outcome_advantage(t([[0.0, 1.0]]), t([[1, 1]]))


# ----------------------------------------------------------------- constant groups

@pytest.mark.parametrize("fn", GROUP_ESTIMATORS, ids=lambda f: f.__name__)
def test_identical_non_integer_rewards_give_exactly_zero(fn):
    """Eight float32 rewards of 0.3: their float32 mean is 1 ulp above 0.3 (residue 2.98e-8), which
    (R - mean) / (std + 1e-6) turned into a same-signed advantage of -0.029.  Must be exactly 0."""
    rewards, mask = outcome([0.3] * 8 + [0.9] * 3, [1, 2, 3, 4, 1, 2, 3, 4, 2, 2, 2], dtype=torch.float32)
    adv, _ = fn(rewards, mask, [0] * 8 + [1] * 3)
    assert torch.equal(adv, torch.zeros_like(adv))


# ----------------------------------------------------------------- non-finite and empty inputs

@pytest.mark.parametrize("fn", GROUP_ESTIMATORS + [compute_reinforce_plus_plus_outcome_advantage],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_non_finite_reward_is_refused_naming_the_sample(fn, bad):
    rewards, mask = outcome([1.0, bad, 0.0, 0.5], [1, 2, 2, 1])
    third = (1.0,) if fn is compute_reinforce_plus_plus_outcome_advantage else ([0, 0, 1, 1],)
    with pytest.raises(ValueError, match=r"non-finite.*sample 1.*sample_mask"):
        fn(rewards, mask, *third)


@pytest.mark.parametrize("fn", GROUP_ESTIMATORS, ids=lambda f: f.__name__)
def test_unscorable_sample_is_left_out_of_the_group(fn):
    """A sample with sample_mask 0 (reward error / timeout / inf) gets advantage 0 and the others get
    exactly what they get without it in the batch; its inf reward cannot NaN the group."""
    rewards, mask = outcome([1.0, 0.0, INF, 0.0, 0.5, 2.0], [1, 2, 3, 2, 1, 2])
    index = ["a", "a", "a", "a", "b", "b"]
    adv, _ = fn(rewards, mask, index, sample_mask=t([1, 1, 0, 1, 1, 1]))
    keep = [0, 1, 3, 4, 5]
    clean, _ = fn(rewards[keep], mask[keep], [index[i] for i in keep])
    assert torch.equal(adv[2], torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(adv[keep], clean)


def test_group_left_with_one_valid_sample_gets_zero():
    """Only one scorable answer in a group of 3: nothing to compare it with -> 0 (not its raw reward)."""
    rewards, mask = outcome([1.0, 0.0, 0.0], [1, 1, 1], width=1)
    for fn in (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage, compute_opo_outcome_advantage):
        adv, _ = fn(rewards, mask, [0, 0, 0], sample_mask=t([1, 0, 0]))
        assert torch.equal(adv, torch.zeros_like(adv)), fn.__name__


def test_sample_mask_shape_is_checked():
    rewards, mask = outcome([1.0, 0.0], [1, 1], width=1)
    with pytest.raises(ValueError, match=r"sample_mask must have shape \(2,\)"):
        compute_grpo_outcome_advantage(rewards, mask, [0, 0], sample_mask=t([1, 1, 1]))


@pytest.mark.parametrize("fn", OUTCOME_ESTIMATORS, ids=lambda f: f.__name__)
def test_all_equal_groups_give_zero_advantage(fn):
    # two groups of three, each with equal scores (0.7 and 0): nothing to prefer within a group
    rewards, mask = outcome_rewards([0.7, 0.7, 0.7, 0.0, 0.0, 0.0], [1, 2, 3, 3, 1, 2], width=3)
    adv, _ = fn(rewards, mask, ["a", "a", "a", "b", "b", "b"])
    assert torch.equal(adv, torch.zeros_like(adv))  # exactly: no round-off residue of mean(0.7)


@pytest.mark.parametrize("fn", OUTCOME_ESTIMATORS, ids=lambda f: f.__name__)
def test_masked_middle_span_is_ignored_by_outcome_estimators(fn):
    # row 0 has a masked span (e.g. a tool observation) holding junk reward 9 at t=1
    rewards = t([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 0, 1], [1, 1, 1]])
    adv, _ = fn(rewards, mask, [0, 0])
    clean, _ = fn(t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), mask, [0, 0])
    torch.testing.assert_close(adv, clean)
    assert adv[0, 1] == 0 and adv[0, 0] == adv[0, 2] > 0 > adv[1, 0]


@pytest.mark.parametrize("fn", OUTCOME_ESTIMATORS + [compute_reinforce_plus_plus_outcome_advantage],
                         ids=lambda f: f.__name__)
def test_padding_width_and_value_invariance(fn):
    scores, lengths, index = [1.0, 0.0, 0.5, 2.0], [2, 3, 1, 2], [0, 0, 1, 1]
    narrow = outcome_rewards(scores, lengths, width=3, pad=0.0)
    wide = outcome_rewards(scores, lengths, width=7, pad=1e9)
    args = (1.0,) if fn is compute_reinforce_plus_plus_outcome_advantage else (index,)
    a3, _ = fn(*narrow, *args)
    a7, _ = fn(*wide, *args)
    torch.testing.assert_close(a7[:, :3], a3)
    assert torch.equal(a7[:, 3:], torch.zeros_like(a7[:, 3:]))
