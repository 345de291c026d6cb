"""ReMax (rlhf/algorithms/estimators/remax.py): return minus the greedy response's reward, by hand.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import pytest
import torch

from rlhf.algorithms import compute_remax_outcome_advantage
from tests.unit.algorithms.helpers import INF, NAN, t


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
