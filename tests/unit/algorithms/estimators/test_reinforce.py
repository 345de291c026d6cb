"""REINFORCE++ and REINFORCE++-baseline (rlhf/algorithms/estimators/reinforce.py) by hand.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import torch

from rlhf.algorithms import (
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
)
from tests.unit.algorithms.helpers import NAN, outcome_rewards, t, whiten


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
