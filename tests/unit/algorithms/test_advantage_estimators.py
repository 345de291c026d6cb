"""Hand-computed checks for the advantage estimators and their registry.

Expected numbers come from comments worked by hand or from plain-python
loops over the valid tokens, never from the functions under test.
"""

import math
import statistics

import numpy as np
import pytest
import torch

from rlhf.algorithms import (
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
)

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def whiten(xs):
    """Plain-python whitening with the unbiased std (what masked_whiten should do)."""
    mean, std = statistics.mean(xs), statistics.stdev(xs)
    return [(x - mean) / math.sqrt(std**2 + 1e-8) for x in xs]


def scatter(valid_values, mask_row):
    """Place values at the mask's valid positions of a row, 0 elsewhere."""
    it = iter(valid_values)
    return [next(it) if m else 0.0 for m in mask_row]


def outcome_rewards(scores, lengths, width, pad=NAN):
    """Outcome reward on the last valid token; NaN in padding to prove it never leaks."""
    rewards, mask = [], []
    for score, n in zip(scores, lengths):
        rewards.append([0.0] * (n - 1) + [score] + [pad] * (width - n))
        mask.append([1] * n + [0] * (width - n))
    return t(rewards), t(mask)


# ----------------------------------------------------------------- GAE

# rewards [0, 0, 1], values [0.5, 0.4, 0.3], gamma 0.9, lam 0.8 (gamma * lam = 0.72):
#   t=2: delta = 1 - 0.3                = 0.7    A = 0.7
#   t=1: delta = 0.9 * 0.3 - 0.4        = -0.13  A = -0.13 + 0.72 * 0.7   = 0.374
#   t=0: delta = 0.9 * 0.4 - 0.5        = -0.14  A = -0.14 + 0.72 * 0.374 = 0.12928
RAW_GAE = [0.12928, 0.374, 0.7]
GAE_RETURNS = [0.62928, 0.774, 1.0]  # A + V


def test_gae_single_row_by_hand():
    adv, ret = compute_gae_advantage_return(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.4, 0.3]]), t([[1, 1, 1]]), 0.9, 0.8)
    torch.testing.assert_close(ret, t([GAE_RETURNS]))
    torch.testing.assert_close(adv, t([whiten(RAW_GAE)]))


def test_gae_padding_after_response_does_not_leak():
    # gamma = lam = 1: t=1: A = 1 - 0.4 = 0.6; t=0: A = 0.4 - 0.5 + 0.6 = 0.5
    rewards = t([[0.0, 1.0, NAN, NAN], [0.0, 0.0, 0.0, 1.0]])
    values = t([[0.5, 0.4, NAN, 1e9], [0.5, 0.4, 0.3, 0.2]])
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    # row 1: A_t = 1 - V_t (undiscounted return 1 from every position)
    row1_raw = [1 - 0.5, 1 - 0.4, 1 - 0.3, 1 - 0.2]
    torch.testing.assert_close(ret, t([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    whitened = whiten([0.5, 0.6] + row1_raw)
    torch.testing.assert_close(adv, t([whitened[:2] + [0.0, 0.0], whitened[2:]]))


def test_gae_masked_middle_span_is_skipped():
    # a masked observation span at t=1 (junk reward 5, value 9) must be invisible:
    # the result equals the hand example on the 3 valid tokens.
    rewards = t([[0.0, 5.0, 0.0, 1.0]])
    values = t([[0.5, 9.0, 0.4, 0.3]])
    mask = t([[1, 0, 1, 1]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, t([scatter(GAE_RETURNS, [1, 0, 1, 1])]))
    torch.testing.assert_close(adv, t([scatter(whiten(RAW_GAE), [1, 0, 1, 1])]))


def test_gae_validation():
    x = t([[0.0, 1.0]])
    with pytest.raises(ValueError, match=r"values=\(1, 1\)"):
        compute_gae_advantage_return(x, x[:, :1], x, 1.0, 1.0)
    with pytest.raises(ValueError, match="response_length"):
        compute_gae_advantage_return(x[0], x[0], x[0], 1.0, 1.0)


# ----------------------------------------------------------------- GRPO

# groups: "a" scores [1, 0, 1]  mean 2/3, unbiased std sqrt(1/3)
#         "b" score  [0.5]      size 1 -> mean 0, std 1
#         "c" scores [2, 2]     all equal -> advantage 0
SCORES = [1.0, 0.0, 1.0, 0.5, 2.0, 2.0]
LENGTHS = [3, 1, 2, 4, 2, 3]
INDEX = np.array(["a", "a", "a", "b", "c", "c"], dtype=object)


def test_grpo_group_normalised_advantage():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, width=4)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, INDEX, epsilon=1e-6)
    std_a = math.sqrt(1 / 3)
    per_seq = [(1 / 3) / (std_a + 1e-6), (-2 / 3) / (std_a + 1e-6), (1 / 3) / (std_a + 1e-6), 0.5 / (1 + 1e-6), 0, 0]
    expected = t([[s] * n + [0.0] * (4 - n) for s, n in zip(per_seq, LENGTHS)])
    torch.testing.assert_close(adv, expected)
    assert ret is adv or torch.equal(ret, adv)


def test_grpo_all_equal_rewards_give_zero_advantage():
    rewards, mask = outcome_rewards([1.0, 1.0, 1.0, 1.0], [2, 2, 2, 2], width=2)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [7, 7, 7, 7])
    assert torch.equal(adv, torch.zeros_like(adv))


def test_grpo_group_size_one_is_score_over_one_plus_eps():
    rewards, mask = outcome_rewards([0.3, -2.0], [1, 2], width=2)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, ["p", "q"], epsilon=1e-6)
    torch.testing.assert_close(adv, t([[0.3 / (1 + 1e-6), 0.0], [-2.0 / (1 + 1e-6)] * 2]))


def test_dr_grpo_skips_std_normalisation():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, width=4)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, INDEX, norm_adv_by_std_in_grpo=False)
    per_seq = [1 / 3, -2 / 3, 1 / 3, 0.5, 0.0, 0.0]
    expected = t([[s] * n + [0.0] * (4 - n) for s, n in zip(per_seq, LENGTHS)])
    torch.testing.assert_close(adv, expected)


def test_grpo_accepts_tensor_and_list_index_and_checks_length():
    rewards, mask = outcome_rewards([1.0, 0.0], [1, 1], width=1)
    by_list, _ = compute_grpo_outcome_advantage(rewards, mask, [3, 3])
    by_tensor, _ = compute_grpo_outcome_advantage(rewards, mask, torch.tensor([3, 3]))
    torch.testing.assert_close(by_list, by_tensor)
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(by_list, t([[0.5 / (math.sqrt(0.5) + 1e-6)], [-0.5 / (math.sqrt(0.5) + 1e-6)]]))
    with pytest.raises(ValueError, match="index has 1 entries"):
        compute_grpo_outcome_advantage(rewards, mask, [3])


# ----------------------------------------------------------------- RLOO

def test_rloo_leave_one_out_numbers():
    scores, index = [3.0, 1.0, 2.0, 4.0], ["g", "g", "g", "solo"]
    rewards, mask = outcome_rewards(scores, [2, 1, 3, 2], width=3)
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    # 3 - mean(1, 2) = 1.5; 1 - mean(3, 2) = -1.5; 2 - mean(3, 1) = 0; singleton keeps its score
    per_seq = [1.5, -1.5, 0.0, 4.0]
    torch.testing.assert_close(adv, t([[s] * n + [0.0] * (3 - n) for s, n in zip(per_seq, [2, 1, 3, 2])]))


def test_rloo_matches_explicit_loop():
    scores = [0.2, 0.9, -0.4, 1.5, 0.0, 0.7]
    index = [0, 1, 0, 1, 0, 1]
    rewards, mask = outcome_rewards(scores, [1] * 6, width=1)
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    expected = []
    for i, (s, g) in enumerate(zip(scores, index)):
        others = [scores[j] for j in range(6) if index[j] == g and j != i]
        expected.append([s - sum(others) / len(others)])
    torch.testing.assert_close(adv, t(expected))


# ----------------------------------------------------------------- REINFORCE++

def test_reinforce_plus_plus_masked_middle_span_carries_return():
    # row 0: valid rewards [0, 0, | masked 7 |, 0, 1], gamma 0.5
    #   returns over valid tokens right to left: 1, 0.5, 0.25, 0.125 (the masked span is skipped, not a reset)
    # row 1: a one-token response with reward 2 followed by NaN padding
    rewards = t([[0.0, 0.0, 7.0, 0.0, 1.0], [2.0, NAN, NAN, NAN, NAN]])
    mask = t([[1, 1, 0, 1, 1], [1, 0, 0, 0, 0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, t([[0.125, 0.25, 0.0, 0.5, 1.0], [2.0, 0.0, 0.0, 0.0, 0.0]]))
    w = whiten([0.125, 0.25, 0.5, 1.0, 2.0])
    torch.testing.assert_close(adv, t([[w[0], w[1], 0.0, w[2], w[3]], [w[4], 0.0, 0.0, 0.0, 0.0]]))


def test_reinforce_plus_plus_matches_python_loop_with_gamma_one():
    rewards = t([[0.5, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=1.0)
    row0, row1 = [0.5, 0.0, 1.0], [0.0, 2.0]  # valid rewards; row 1 has one padded slot
    expected = [[sum(row0[j:]) for j in range(3)], [sum(row1[j:]) for j in range(2)] + [0.0]]
    torch.testing.assert_close(ret, t(expected))


def test_reinforce_plus_plus_baseline():
    # group "a" scores [1, 0] -> minus mean 0.5 -> [0.5, -0.5]; singleton "b" [3] -> baseline 0 -> 3
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0], [2, 1, 3], width=3)
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "b"])
    w = whiten([0.5, 0.5, -0.5, 3.0, 3.0, 3.0])  # broadcast over the 2 + 1 + 3 valid tokens
    torch.testing.assert_close(adv, t([[w[0], w[1], 0.0], [w[2], 0.0, 0.0], w[3:]]))
    torch.testing.assert_close(ret, adv)


# ----------------------------------------------------------------- registry

@pytest.mark.parametrize(
    "name,fn",
    [
        ("gae", compute_gae_advantage_return),
        ("grpo", compute_grpo_outcome_advantage),
        ("rloo", compute_rloo_outcome_advantage),
        ("reinforce_plus_plus", compute_reinforce_plus_plus_outcome_advantage),
        ("reinforce_plus_plus_baseline", compute_reinforce_plus_plus_baseline_outcome_advantage),
    ],
)
def test_registry_lookup_by_string_and_enum(name, fn):
    assert get_adv_estimator_fn(name) is fn
    assert get_adv_estimator_fn(AdvantageEstimator(name)) is fn
    assert AdvantageEstimator(name) == name


def test_registry_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'ppo2'.*'gae'.*'grpo'"):
        get_adv_estimator_fn("ppo2")


# ----------------------------------------------------------------- critic-free estimators: edge cases

GROUP_ESTIMATORS = [compute_grpo_outcome_advantage, compute_rloo_outcome_advantage,
                    compute_reinforce_plus_plus_baseline_outcome_advantage]


@pytest.mark.parametrize("fn", GROUP_ESTIMATORS, ids=lambda f: f.__name__)
def test_all_equal_groups_give_zero_advantage(fn):
    # two groups of three, each with equal scores (0.7 and 0): nothing to prefer within a group
    rewards, mask = outcome_rewards([0.7, 0.7, 0.7, 0.0, 0.0, 0.0], [1, 2, 3, 3, 1, 2], width=3)
    adv, _ = fn(rewards, mask, ["a", "a", "a", "b", "b", "b"])
    assert torch.equal(adv, torch.zeros_like(adv))  # exactly: no round-off residue of mean(0.7)


@pytest.mark.parametrize("fn", GROUP_ESTIMATORS, ids=lambda f: f.__name__)
def test_masked_middle_span_is_ignored_by_outcome_estimators(fn):
    # row 0 has a masked span (e.g. a tool observation) holding junk reward 9 at t=1
    rewards = t([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 0, 1], [1, 1, 1]])
    adv, _ = fn(rewards, mask, [0, 0])
    clean, _ = fn(t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), mask, [0, 0])
    torch.testing.assert_close(adv, clean)
    assert adv[0, 1] == 0 and adv[0, 0] == adv[0, 2] > 0 > adv[1, 0]


@pytest.mark.parametrize("fn", GROUP_ESTIMATORS + [compute_reinforce_plus_plus_outcome_advantage],
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
