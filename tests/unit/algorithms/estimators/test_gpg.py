"""GPG's advantage (rlhf/algorithms/estimators/gpg.py) by hand.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import pytest
import torch

from rlhf.algorithms import compute_gpg_outcome_advantage

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
