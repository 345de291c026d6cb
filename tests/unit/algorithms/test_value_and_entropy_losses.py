"""Hand-computed checks of the critic's clipped value loss (value_loss.py) and the entropy bonus (entropy.py).

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import math

import pytest
import torch

from rlhf.algorithms import compute_entropy_loss, compute_value_loss
from tests.unit.algorithms.helpers import INF, NAN, t


# ----------------------------------------------------------------- value / entropy loss

def test_value_loss_clip_by_hand():
    # old values 1.0, clip 0.2 -> vpred clipped into [0.8, 1.2]
    #  vpred 1.5, ret 2.0: (1.5-2)^2 = 0.25 vs (1.2-2)^2 = 0.64 -> 0.64 (clipped term wins)
    #  vpred 0.9, ret 0.0: 0.81 vs 0.81 -> 0.81
    #  vpred 2.0, ret 1.0: 1.00 vs (1.2-1)^2 = 0.04 -> 1.00
    vpreds = t([[1.5, 0.9, 2.0, NAN]]).requires_grad_()
    returns = t([[2.0, 0.0, 1.0, NAN]])
    values = t([[1.0, 1.0, 1.0, NAN]])
    mask = t([[1, 1, 1, 0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 1.0) / 3)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)
    vf_loss.backward()
    # 0.5 * d(vpred - ret)^2 / 3 tokens = (vpred - ret) / 3 where unclipped; 0 where clipped or padded
    torch.testing.assert_close(vpreds.grad, t([[0.0, 0.9 / 3, 1.0 / 3, 0.0]]))


def test_entropy_loss_from_logits_aggregation():
    """verl's signature: compute_entropy_loss(logits (bs, L, V), mask, mode).
    H([0, 0]) = H([5, 5]) = ln 2; H([0, ln 3]) = H(1/4, 3/4) = -(1/4 ln 1/4 + 3/4 ln 3/4); NaN padding ignored."""
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    logits = t([[[0.0, 0.0], [0.0, math.log(3)], [NAN, NAN]], [[5.0, 5.0], [NAN, INF], [NAN, NAN]]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert compute_entropy_loss(logits, mask, "token-mean").item() == pytest.approx((2 * math.log(2) + h) / 3)
    assert compute_entropy_loss(logits, mask, "seq-mean-token-mean").item() == pytest.approx(
        ((math.log(2) + h) / 2 + math.log(2)) / 2)
    with pytest.raises(ValueError, match="agg_loss"):
        compute_entropy_loss(t([[1.0, 2.0]]), t([[1, 1]]))
