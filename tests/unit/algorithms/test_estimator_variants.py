"""Hand-computed checks of the estimators added for verl parity (ReMax, OPO, GPG, pass@k GRPO,
the *_vectorized names), of verl's ``config=`` calling convention, of ``sample_mask``
(unscorable samples left out of the group baseline) and of the numerical-safety kinds:
constant groups give EXACTLY zero advantage, non-finite rewards are refused.

Expected numbers are worked out in the docstrings / comments, never by the function under test.
"""

import math
import statistics

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
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
    masked_whiten,
)

NAN, INF = float("nan"), float("inf")
EPS = 1e-6


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def outcome(scores, lengths, width=4, dtype=torch.float64):
    """Outcome reward on the last valid token, NaN padding (must never leak)."""
    rewards = [[0.0] * (n - 1) + [s] + [NAN] * (width - n) for s, n in zip(scores, lengths)]
    mask = [[1] * n + [0] * (width - n) for n in lengths]
    return t(rewards, dtype), t(mask, dtype)


def per_sample(adv):
    """The advantage of each row (every valid token carries the same scalar)."""
    return adv[:, 0].tolist()


GROUP_ESTIMATORS = [
    compute_grpo_outcome_advantage, compute_grpo_vectorized_outcome_advantage, compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage, compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_opo_outcome_advantage, compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage,
]


# ----------------------------------------------------------------- ReMax

def test_remax_return_minus_greedy_baseline():
    """ReMax: A_t = sum_{t'>=t} r_t' - b.
    row 0: outcome 1.0 on 3 tokens, b = 0.25      -> A = 0.75 everywhere, G = 1
    row 1: rewards [0.5, 0, (0.25 masked)], b = 0.5 -> G = [0.5, 0, 0], A = [0, -0.5, 0]
    row 2: reward 0.3 equal to its baseline 0.3  -> exactly 0"""
    rewards = t([[0.0, 0.0, 1.0], [0.5, 0.0, 0.25], [0.0, 0.3, NAN]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    adv, ret = compute_remax_outcome_advantage(rewards, t([0.25, 0.5, 0.3]), mask)
    torch.testing.assert_close(adv, t([[0.75, 0.75, 0.75], [0.0, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0], [0.5, 0.0, 0.0], [0.3, 0.3, 0.0]]))
    assert torch.equal(adv[2], torch.zeros(3, dtype=torch.float64))


def test_remax_refuses_non_finite_baseline_of_a_valid_sample_only():
    rewards, mask = t([[1.0], [1.0]]), t([[1], [1]])
    with pytest.raises(ValueError, match="reward_baselines.*sample 1"):
        compute_remax_outcome_advantage(rewards, t([0.0, INF]), mask)
    adv, _ = compute_remax_outcome_advantage(rewards, t([0.0, INF]), mask, sample_mask=t([1, 0]))
    torch.testing.assert_close(adv, t([[1.0], [0.0]]))


# ----------------------------------------------------------------- OPO

def test_opo_length_weighted_baseline():
    """OPO: b = sum l_i R_i / sum l_i.  group a: R = [1, 0, 0], l = [2, 4, 2] -> b = 2/8 = 0.25,
    A = [0.75, -0.25, -0.25]; group b (size 1): b = 0, A = 0.5."""
    rewards, mask = outcome([1.0, 0.0, 0.0, 0.5], [2, 4, 2, 3])
    adv, ret = compute_opo_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    assert per_sample(adv) == pytest.approx([0.75, -0.25, -0.25, 0.5])
    assert adv[0, 2] == 0 and adv[3, 3] == 0  # padding
    assert torch.equal(adv, ret)


# ----------------------------------------------------------------- GPG

def test_gpg_alpha_is_batch_over_informative_samples():
    """GPG: A = alpha (R - mean_g) / F_norm, alpha = B / (B - M).
    groups: a = [1, 0] (centred [0.5, -0.5]); b = [1, 1] and c = [0, 0] constant (M = 4); B = 6:
    alpha = 6 / 2 = 3 -> A = [1.5, -1.5, 0, 0, 0, 0]; with F_norm = 2 -> [0.75, -0.75, 0, ...]."""
    rewards, mask = outcome([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [1, 2, 3, 1, 2, 3])
    index = ["a", "a", "b", "b", "c", "c"]
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, index)
    assert per_sample(adv) == pytest.approx([1.5, -1.5, 0, 0, 0, 0])
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, index, f_norm=2.0)
    assert per_sample(adv) == pytest.approx([0.75, -0.75, 0, 0, 0, 0])
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, index, alpha=1.0)  # fixed alpha
    assert per_sample(adv) == pytest.approx([0.5, -0.5, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="f_norm"):
        compute_gpg_outcome_advantage(rewards, mask, index, f_norm=0.0)


# ----------------------------------------------------------------- pass@k GRPO

def test_grpo_passk_only_the_best_response_gets_max_minus_second():
    """A_i = max_j R_j - max_{j != i} R_j: group a R = [0.2, 0.9, 0.5, 0.1] -> A = [0, 0.4, 0, 0],
    divided by (unbiased std + eps) when normalising; group b has a tie for best [0.7, 0.7, 0.1] -> 0."""
    rewards, mask = outcome([0.2, 0.9, 0.5, 0.1, 0.7, 0.7, 0.1], [1, 2, 3, 4, 1, 2, 3])
    index = [0, 0, 0, 0, 1, 1, 1]
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert per_sample(adv) == pytest.approx([0, 0.4, 0, 0, 0, 0, 0])
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, config={"norm_adv_by_std_in_grpo": True})
    std = statistics.stdev([0.2, 0.9, 0.5, 0.1])  # sqrt(0.3875 / 3)
    assert per_sample(adv) == pytest.approx([0, 0.4 / (std + EPS), 0, 0, 0, 0, 0])
    # the best sample unscorable: best of the rest 0.5 minus 0.2, over the std of [0.2, 0.5, 0.1]
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, sample_mask=t([1, 0, 1, 1, 1, 1, 1]))
    std = statistics.stdev([0.2, 0.5, 0.1])
    assert per_sample(adv) == pytest.approx([0, 0, 0.3 / (std + EPS), 0, 0, 0, 0])


def test_grpo_passk_needs_two_samples_per_prompt():
    rewards, mask = outcome([1.0, 0.0, 1.0], [1, 1, 1])
    with pytest.raises(ValueError, match=r"rollout.n >= 2"):
        compute_grpo_passk_outcome_advantage(rewards, mask, [0, 0, 1])


# ----------------------------------------------------------------- verl names and calling convention

def test_vectorized_names_give_the_loop_values():
    rewards, mask = outcome([1.0, 0.0, 0.5, 2.0, 3.0], [1, 2, 3, 4, 2])
    index = [0, 0, 0, 1, 1]
    for plain, vectorized in [(compute_grpo_outcome_advantage, compute_grpo_vectorized_outcome_advantage),
                              (compute_rloo_outcome_advantage, compute_rloo_vectorized_outcome_advantage)]:
        torch.testing.assert_close(vectorized(rewards, mask, index)[0], plain(rewards, mask, index)[0])
    assert get_adv_estimator_fn("grpo_vectorized") is compute_grpo_vectorized_outcome_advantage
    assert get_adv_estimator_fn("rloo_vectorized") is compute_rloo_vectorized_outcome_advantage


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


def test_masked_whiten_of_a_constant_is_exactly_zero():
    """GAE / REINFORCE++ whiten over the batch: mean(0.3 x 8) in float32 is 1 ulp off, and dividing the
    residue by sqrt(0 + 1e-8) gave 3e-4; a constant must whiten to exactly 0 (or itself unshifted)."""
    values, mask = torch.full((2, 4), 0.3), torch.ones(2, 4)
    assert torch.equal(masked_whiten(values, mask), torch.zeros(2, 4))
    assert torch.equal(masked_whiten(values, mask, shift_mean=False), values)
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(*outcome([0.3] * 8, [1] * 8, 1, torch.float32), gamma=1.0)
    assert torch.equal(adv, torch.zeros_like(adv)) and torch.equal(ret, torch.full_like(ret, 0.3))


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


def test_grpo_sample_mask_hand_values():
    """group a valid R = [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3);
    A = (2/3) / (sqrt(1/3) + eps), (-1/3) / (sqrt(1/3) + eps); the invalid 4th sample (R = 5) gets 0."""
    rewards, mask = outcome([1.0, 0.0, 0.0, 5.0], [1, 1, 1, 1], width=1)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0, 0, 0], sample_mask=torch.tensor([1, 1, 1, 0]))
    s = math.sqrt(1 / 3) + EPS
    assert per_sample(adv) == pytest.approx([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0])


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
