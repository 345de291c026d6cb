"""GAE (rlhf/algorithms/estimators/gae.py) by hand: the recursion, padding, masked spans, validation.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import pytest
import torch

from rlhf.algorithms import compute_gae_advantage_return
from tests.unit.algorithms.helpers import NAN, scatter, t, whiten


# ----------------------------------------------------------------- GAE

# rewards [0, 0, 1], values [0.5, 0.4, 0.3], gamma 0.9, lam 0.8 (gamma * lam = 0.72):
#   t=2: delta = 1 - 0.3                = 0.7    A = 0.7
#   t=1: delta = 0.9 * 0.3 - 0.4        = -0.13  A = -0.13 + 0.72 * 0.7   = 0.374
#   t=0: delta = 0.9 * 0.4 - 0.5        = -0.14  A = -0.14 + 0.72 * 0.374 = 0.12928
RAW_GAE = [0.12928, 0.374, 0.7]
GAE_RETURNS = [0.62928, 0.774, 1.0]  # A + V


def test_gae_single_row_by_hand():
    adv, ret = compute_gae_advantage_return(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.4, 0.3]]), t([[1, 1, 1]]), 0.9, 0.8)
    torch.testing.assert_close(ret, t([GAE_RETURNS]))
    torch.testing.assert_close(adv, t([whiten(RAW_GAE)]))


def test_gae_padding_after_response_does_not_leak():
    # gamma = lam = 1: t=1: A = 1 - 0.4 = 0.6; t=0: A = 0.4 - 0.5 + 0.6 = 0.5
    rewards = t([[0.0, 1.0, NAN, NAN], [0.0, 0.0, 0.0, 1.0]])
    values = t([[0.5, 0.4, NAN, 1e9], [0.5, 0.4, 0.3, 0.2]])
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    # row 1: A_t = 1 - V_t (undiscounted return 1 from every position)
    row1_raw = [1 - 0.5, 1 - 0.4, 1 - 0.3, 1 - 0.2]
    torch.testing.assert_close(ret, t([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    whitened = whiten([0.5, 0.6] + row1_raw)
    torch.testing.assert_close(adv, t([whitened[:2] + [0.0, 0.0], whitened[2:]]))


def test_gae_masked_middle_span_is_skipped():
    # a masked observation span at t=1 (junk reward 5, value 9) must be invisible:
    # the result equals the hand example on the 3 valid tokens.
    rewards = t([[0.0, 5.0, 0.0, 1.0]])
    values = t([[0.5, 9.0, 0.4, 0.3]])
    mask = t([[1, 0, 1, 1]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, t([scatter(GAE_RETURNS, [1, 0, 1, 1])]))
    torch.testing.assert_close(adv, t([scatter(whiten(RAW_GAE), [1, 0, 1, 1])]))


def test_gae_validation():
    x = t([[0.0, 1.0]])
    with pytest.raises(ValueError, match=r"values=\(1, 1\)"):
        compute_gae_advantage_return(x, x[:, :1], x, 1.0, 1.0)
    with pytest.raises(ValueError, match="response_length"):
        compute_gae_advantage_return(x[0], x[0], x[0], 1.0, 1.0)
