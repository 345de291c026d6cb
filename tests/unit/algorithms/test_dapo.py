"""Hand-computed checks of DAPO's sampling-side helpers (rlhf/algorithms/dapo.py): the soft overlong
penalty (DAPO eq. 13) and the dynamic-sampling group filter (eq. 11).  The trainer's loop is tested in
tests/unit/trainer/test_dynamic_sampling.py.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import numpy as np
import pytest
import torch

from rlhf.algorithms import compute_overlong_penalty, filter_groups_by_metric
from tests.unit.algorithms.helpers import NAN, t


# ----------------------------------------------------------------- DAPO helpers

def test_overlong_penalty_documented_values():
    # L_max = 20, buffer 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    expected = t([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0], torch.float32)
    torch.testing.assert_close(compute_overlong_penalty(lengths, 20, 4, 1.0), expected)
    torch.testing.assert_close(compute_overlong_penalty(lengths, 20, 4, 0.5), expected * 0.5)


def test_overlong_penalty_validation():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        compute_overlong_penalty(torch.tensor([1]), 20, 0, 1.0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        compute_overlong_penalty(torch.tensor([1]), 20, 21, 1.0)
    with pytest.raises(ValueError, match=r"\(batch,\)"):
        compute_overlong_penalty(torch.tensor([[1]]), 20, 4, 1.0)


def test_filter_groups_keeps_only_groups_with_varied_metric():
    metric = [1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0]
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d"], dtype=object)
    kept = filter_groups_by_metric(metric, index)
    assert kept.tolist() == [False, False, False, True, True, True, False, False]
    kept = filter_groups_by_metric(torch.tensor(metric), list(index), keep_singleton_groups=False)
    assert kept.tolist() == [False, False, False, True, True, False, False, False]


def test_filter_groups_exact_equality_despite_round_off():
    # mean of three 0.1s is not exactly 0.1 in floating point; the group must still be dropped
    kept = filter_groups_by_metric([0.1, 0.1, 0.1, 0.1, 0.2], [0, 0, 0, 1, 1])
    assert kept.tolist() == [False, False, False, True, True]
    with pytest.raises(ValueError, match="index has 2 entries"):
        filter_groups_by_metric([0.1, 0.2, 0.3], [0, 0])


def test_filter_groups_refuses_non_finite_metric():
    """A NaN metric would drop its group silently (NaN > NaN is False); it is refused, naming the sample."""
    with pytest.raises(ValueError, match=r"non-finite at sample\(s\) \[2\]"):
        filter_groups_by_metric([1.0, 0.0, NAN, 1.0], [0, 0, 1, 1])
