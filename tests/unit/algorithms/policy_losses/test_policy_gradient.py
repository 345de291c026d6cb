"""REINFORCE-form losses (rlhf/algorithms/policy_losses/policy_gradient.py) by hand: GPG, CISPO.

Shared inputs as in test_sequence_level.py (old_log_prob = 0, rows of unequal length).
"""

import math

import pytest
import torch

from tests.unit.algorithms.helpers import grad, run


def test_gpg_plain_policy_gradient():
    """GPG: -A log pi, token-mean over 5 tokens: (-0.1 - 0.3 + 0.5 * (0 - 0.3 + 0)) / 5 = -0.11;
    gradient -A / 5: row 0 -0.2, row 1 +0.1."""
    loss, g, _ = run("gpg")
    assert loss == pytest.approx(-0.11)
    torch.testing.assert_close(g, grad([[-0.2, -0.2, 0.0], [0.1, 0.1, 0.1]]))


def test_cispo_clipped_stop_gradient_weight():
    """CISPO, eps 0.2: r_hat = clip(r, 0.8, 1.2) (detached): row 0 [exp(0.1), 1.2 (clipped from exp(0.3))],
    row 1 [1, 0.8 (clipped from exp(-0.3) = 0.741), 1].  loss = sum -r_hat A log pi / 5
        = (-(exp(0.1) * 0.1) - 1.2 * 0.3 + 0.5 * 0.8 * (-0.3)) / 5
    gradient -r_hat A / 5 on EVERY token (clipped ones included): that is the point of CISPO."""
    loss, g, metrics = run("cispo", {"clip_ratio": 0.2})
    assert loss == pytest.approx((-math.exp(0.1) * 0.1 - 1.2 * 0.3 + 0.5 * 0.8 * -0.3) / 5)
    torch.testing.assert_close(g, grad([[-math.exp(0.1) / 5, -1.2 / 5, 0.0], [0.5 / 5, 0.4 / 5, 0.5 / 5]]))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
