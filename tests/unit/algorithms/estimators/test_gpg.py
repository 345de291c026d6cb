"""GPG's advantage (rlhf/algorithms/estimators/gpg.py) by hand.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import pytest

from rlhf.algorithms import compute_gpg_outcome_advantage
from tests.unit.algorithms.helpers import outcome, per_sample


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
