"""OPO's length-weighted baseline (rlhf/algorithms/estimators/opo.py) by hand.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import pytest
import torch

from rlhf.algorithms import compute_opo_outcome_advantage

NAN, INF = float("nan"), float("inf")


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


# ----------------------------------------------------------------- OPO

def test_opo_length_weighted_baseline():
    """OPO: b = sum l_i R_i / sum l_i.  group a: R = [1, 0, 0], l = [2, 4, 2] -> b = 2/8 = 0.25,
    A = [0.75, -0.25, -0.25]; group b (size 1): b = 0, A = 0.5."""
    rewards, mask = outcome([1.0, 0.0, 0.0, 0.5], [2, 4, 2, 3])
    adv, ret = compute_opo_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    assert per_sample(adv) == pytest.approx([0.75, -0.25, -0.25, 0.5])
    assert adv[0, 2] == 0 and adv[3, 3] == 0  # padding
    assert torch.equal(adv, ret)
