"""OPO's length-weighted baseline (rlhf/algorithms/estimators/opo.py) by hand.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import pytest
import torch

from rlhf.algorithms import compute_opo_outcome_advantage
from tests.unit.algorithms.helpers import outcome, per_sample


# ----------------------------------------------------------------- OPO

def test_opo_length_weighted_baseline():
    """OPO: b = sum l_i R_i / sum l_i.  group a: R = [1, 0, 0], l = [2, 4, 2] -> b = 2/8 = 0.25,
    A = [0.75, -0.25, -0.25]; group b (size 1): b = 0, A = 0.5."""
    rewards, mask = outcome([1.0, 0.0, 0.0, 0.5], [2, 4, 2, 3])
    adv, ret = compute_opo_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    assert per_sample(adv) == pytest.approx([0.75, -0.25, -0.25, 0.5])
    assert adv[0, 2] == 0 and adv[3, 3] == 0  # padding
    assert torch.equal(adv, ret)
