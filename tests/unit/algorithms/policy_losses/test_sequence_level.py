"""Sequence-level ratio losses (rlhf/algorithms/policy_losses/sequence_level.py) by hand: GSPO, GMPO.

Shared inputs (old_log_prob = 0, so log r = log_prob): two responses of UNEQUAL length,
    row 0: log_prob [0.1, 0.3, pad], A = +1 on both tokens
    row 1: log_prob [0.0, -0.3, 0.0], A = -0.5 on all three tokens
"""

import math

import pytest
import torch

from tests.unit.algorithms.helpers import grad, run


def test_gspo_sequence_ratio_on_unequal_lengths():
    """GSPO: s_i = exp(mean_t log r):  s_0 = exp((0.1 + 0.3) / 2) = exp(0.2),  s_1 = exp(-0.3 / 3) = exp(-0.1).
    clip 0.3 leaves both inside [0.7, 1.3].  seq-mean-token-mean of -A s:
        loss = (-exp(0.2) + 0.5 exp(-0.1)) / 2
    gradient of token t of row i = -A_i s_i / |y_i| / 2 (the SAME for every token of a row,
    although the token ratios exp(0.1) and exp(0.3) differ):
        row 0: -exp(0.2) / 4,   row 1: 0.5 exp(-0.1) / 6"""
    loss, g, metrics = run("gspo", {"clip_ratio": 0.3}, agg="token-mean")  # the mode is ignored: always seq-mean
    assert loss == pytest.approx((-math.exp(0.2) + 0.5 * math.exp(-0.1)) / 2)
    a, b = -math.exp(0.2) / 4, 0.5 * math.exp(-0.1) / 6
    torch.testing.assert_close(g, grad([[a, a, 0.0], [b, b, b]]))
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.3 - 0.3) / 5)


def test_gspo_clips_whole_sequences():
    """clip 0.2: s_0 = exp(0.2) = 1.2214 > 1.2 with A > 0 -> both tokens of row 0 clipped (loss -1.2 each,
    gradient 0); row 1 unclipped.  loss = (-1.2 + 0.5 exp(-0.1)) / 2, clipfrac = 2 of 5 tokens."""
    loss, g, metrics = run("gspo", {"clip_ratio": 0.2})
    assert loss == pytest.approx((-1.2 + 0.5 * math.exp(-0.1)) / 2)
    b = 0.5 * math.exp(-0.1) / 6
    torch.testing.assert_close(g, grad([[0.0, 0.0, 0.0], [b, b, b]]))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)


def test_geo_mean_gmpo():
    """GMPO, log-space clip [-0.2, 0.2]:
    row 0 (A > 0): d = [0.1, 0.3] -> min(d, clip(d)) = [0.1, 0.2]; ratio exp(0.15); l_0 = -exp(0.15)
    row 1 (A < 0): d = [0, -0.3, 0] -> -min(-d, -clip(d)) = [0, -0.2, 0]; ratio exp(-0.2/3); l_1 = 0.5 exp(-0.2/3)
    loss = (l_0 + l_1) / 2.  Gradients: clipped tokens 0; row 0 token 0: -exp(0.15) / 2 / 2;
    row 1 tokens 0, 2: 0.5 exp(-0.2/3) / 3 / 2."""
    loss, g, metrics = run("geo_mean", {"clip_ratio": 0.2})
    assert loss == pytest.approx((-math.exp(0.15) + 0.5 * math.exp(-0.2 / 3)) / 2)
    b = 0.5 * math.exp(-0.2 / 3) / 3 / 2
    torch.testing.assert_close(g, grad([[-math.exp(0.15) / 4, 0.0, 0.0], [b, 0.0, b]]))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 5)  # token (0, 1), A > 0
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # token (1, 1), A < 0
