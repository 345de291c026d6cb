"""Hand-computed checks of the masked reductions and whitening (rlhf/algorithms/masked_ops.py).

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import statistics

import pytest
import torch

from rlhf.algorithms import compute_reinforce_plus_plus_outcome_advantage, masked_mean, masked_var, masked_whiten
from tests.unit.algorithms.helpers import INF, NAN, outcome, t


# ----------------------------------------------------------------- masked ops

VALUES = t([[1.0, 2.0, NAN], [4.0, INF, 6.0]])
MASK = t([[1, 1, 0], [1, 0, 1]])
VALID = [1.0, 2.0, 4.0, 6.0]


def test_masked_mean_ignores_nan_and_inf_padding():
    assert masked_mean(VALUES, MASK).item() == pytest.approx(13 / 4)
    torch.testing.assert_close(masked_mean(VALUES, MASK, axis=-1), t([1.5, 5.0]))


def test_masked_mean_of_empty_row_is_zero():
    row_means = masked_mean(t([[NAN, 1.0], [2.0, 4.0]]), t([[0, 0], [1, 1]]), axis=-1)
    torch.testing.assert_close(row_means, t([0.0, 3.0]))


def test_masked_mean_accepts_bool_mask():
    assert masked_mean(VALUES, MASK.bool()).item() == pytest.approx(3.25)


def test_masked_var_unbiased_and_biased():
    # mean 3.25; squared deviations 5.0625 + 1.5625 + 0.5625 + 7.5625 = 14.75
    assert masked_var(VALUES, MASK).item() == pytest.approx(14.75 / 3)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(14.75 / 4)
    assert masked_var(VALUES, MASK).item() == pytest.approx(statistics.variance(VALID))


def test_masked_var_needs_two_valid_entries():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(t([[1.0, 2.0]]), t([[1, 0]]))


def test_masked_whiten_uses_unbiased_std_and_zeroes_padding():
    mean, std = statistics.mean(VALID), statistics.stdev(VALID)
    expected = t([[(1 - mean) / std, (2 - mean) / std, 0.0], [(4 - mean) / std, 0.0, (6 - mean) / std]])
    torch.testing.assert_close(masked_whiten(VALUES, MASK), expected, atol=1e-7, rtol=1e-7)
    shifted = expected + mean * MASK
    torch.testing.assert_close(masked_whiten(VALUES, MASK, shift_mean=False), shifted, atol=1e-7, rtol=1e-7)


def test_masked_ops_reject_shape_mismatch():
    with pytest.raises(ValueError, match=r"values=\(2, 3\), mask=\(2, 2\)"):
        masked_mean(VALUES, MASK[:, :2])


def test_masked_whiten_of_a_constant_is_exactly_zero():
    """GAE / REINFORCE++ whiten over the batch: mean(0.3 x 8) in float32 is 1 ulp off, and dividing the
    residue by sqrt(0 + 1e-8) gave 3e-4; a constant must whiten to exactly 0 (or itself unshifted)."""
    values, mask = torch.full((2, 4), 0.3), torch.ones(2, 4)
    assert torch.equal(masked_whiten(values, mask), torch.zeros(2, 4))
    assert torch.equal(masked_whiten(values, mask, shift_mean=False), values)
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(*outcome([0.3] * 8, [1] * 8, 1, torch.float32), gamma=1.0)
    assert torch.equal(adv, torch.zeros_like(adv)) and torch.equal(ret, torch.full_like(ret, 0.3))
