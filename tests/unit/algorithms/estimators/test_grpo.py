"""The GRPO family (rlhf/algorithms/estimators/grpo.py) by hand: GRPO, Dr.GRPO (no std division),
pass@k GRPO, the *_vectorized names and ``sample_mask`` in a group.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import math
import statistics

import numpy as np
import pytest
import torch

from rlhf.algorithms import (
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
)
from tests.unit.algorithms.helpers import EPS, outcome, outcome_rewards, per_sample, t


# ----------------------------------------------------------------- GRPO

# groups: "a" scores [1, 0, 1]  mean 2/3, unbiased std sqrt(1/3)
#         "b" score  [0.5]      size 1 -> mean 0, std 1
#         "c" scores [2, 2]     all equal -> advantage 0
SCORES = [1.0, 0.0, 1.0, 0.5, 2.0, 2.0]
LENGTHS = [3, 1, 2, 4, 2, 3]
INDEX = np.array(["a", "a", "a", "b", "c", "c"], dtype=object)


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


def test_grpo_sample_mask_hand_values():
    """group a valid R = [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3);
    A = (2/3) / (sqrt(1/3) + eps), (-1/3) / (sqrt(1/3) + eps); the invalid 4th sample (R = 5) gets 0."""
    rewards, mask = outcome([1.0, 0.0, 0.0, 5.0], [1, 1, 1, 1], width=1)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0, 0, 0], sample_mask=torch.tensor([1, 1, 1, 0]))
    s = math.sqrt(1 / 3) + EPS
    assert per_sample(adv) == pytest.approx([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0])


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
