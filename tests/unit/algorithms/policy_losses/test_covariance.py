"""Clip-Cov / KL-Cov (Cui et al. 2025, arXiv:2505.22617): the covariance-based token selection by hand.

Four valid tokens (row 0) plus a fully padded row of NaN (row 1, must not enter the means):
    A        = [ 2,  2, -2, -2]          mean 0
    log pi   = [ 0, -3, -0.5, -2.5]      mean -1.5 -> centred [1.5, -1.5, 1, -1]
    Cov_t = (A_t - mean A)(log pi_t - mean log pi) = [3, -3, -2, 2]
Clip-Cov candidates: clip_cov_lb = 1 < Cov < 5 = clip_cov_ub -> tokens 0 and 3.
KL-Cov top-1 by Cov: token 0; top-2: tokens 0 and 3.
"""

import math

import pytest
import torch

from rlhf.algorithms import get_policy_loss_fn
from tests.unit.algorithms.helpers import NAN

A = [2.0, 2.0, -2.0, -2.0]
LOGP = [0.0, -3.0, -0.5, -2.5]


def make(delta=(0.0, 0.0, 0.0, 0.0)):
    """old_log_prob = log pi - delta, so log r = delta."""
    log_prob = torch.tensor([LOGP, [NAN] * 4], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[lp - d for lp, d in zip(LOGP, delta)], [NAN] * 4], dtype=torch.float64)
    adv = torch.tensor([A, [NAN] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float64)
    return old, log_prob, adv, mask


def clip_cov(config, delta=(0.0, 0.0, 0.0, 0.0)):
    old, log_prob, adv, mask = make(delta)
    loss, metrics = get_policy_loss_fn("clip_cov")(old, log_prob, adv, mask, "token-mean", config)
    loss.backward()
    return loss.item(), log_prob.grad[0].tolist(), metrics


def kl_cov(ratio, delta):
    old, log_prob, adv, mask = make(delta)
    loss, metrics = get_policy_loss_fn("kl_cov")(old, log_prob, adv, mask, "token-mean",
                                                 {"policy_loss": {"kl_cov_ratio": ratio, "ppo_kl_coef": 0.1}})
    loss.backward()
    return loss.item(), log_prob.grad[0].tolist(), metrics


DELTA = (0.1, 0.2, -0.3, 0.4)


def test_clip_cov_zeroes_the_high_covariance_tokens():
    """clip_cov_ratio 0.5 -> max(1, int(0.5 * 4)) = 2 tokens: both candidates (0 and 3) lose their
    loss and gradient.  r = 1, token-mean: loss = (-A_1 - A_2) / 4 = 0; gradient -A_t / 4 on tokens 1, 2."""
    loss, g, metrics = clip_cov({"policy_loss": {"clip_cov_ratio": 0.5}})
    assert loss == pytest.approx(0.0)
    assert g == pytest.approx([0.0, -0.5, 0.5, 0.0])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 4)


def test_clip_cov_picks_k_random_candidates():
    """Default ratio 0.0002 -> max(1, int(0.0008)) = 1 token: one of the two candidates, chosen at random."""
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        _, g, metrics = clip_cov(None)
        zeroed = [i for i, x in enumerate(g) if x == 0.0]
        assert len(zeroed) == 1 and zeroed[0] in (0, 3) and metrics["actor/pg_clipfrac"] == 0.25
        seen.add(zeroed[0])
    assert seen == {0, 3}


def test_clip_cov_skips_tokens_the_ppo_clip_already_clipped():
    """Token 0 gets log r = 0.5 (r = 1.65 > 1.2 with A > 0: clipped by PPO), so only token 3 is a candidate;
    with room for 2 only token 3 is removed: pg_clipfrac = 1/4.  Loss: token 0 -2 * 1.2, tokens 1, 2: -2, +2."""
    loss, g, metrics = clip_cov({"policy_loss": {"clip_cov_ratio": 0.5}}, delta=(0.5, 0.0, 0.0, 0.0))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 4)
    assert loss == pytest.approx((-2 * 1.2 - 2 + 2) / 4)
    assert g == pytest.approx([0.0, -0.5, 0.5, 0.0])


def test_clip_cov_bounds_select_the_candidates():
    """lb = 2.5: only Cov = 3 (token 0) qualifies, even with room for 2."""
    _, g, _ = clip_cov({"policy_loss": {"clip_cov_ratio": 0.5, "clip_cov_lb": 2.5}})
    assert g == pytest.approx([0.0, -0.5, 0.5, 0.5])


@pytest.mark.parametrize("ratio,penalised", [(0.25, [0]), (0.5, [0, 3]), (5.0, [0, 1, 2, 3])])  # k <= N
def test_kl_cov_penalises_the_top_covariance_tokens(ratio, penalised):
    """k = max(1, int(4 * ratio)).  Token loss -A e^delta (no clip) + 0.1 |delta| on the top-k Cov tokens;
    gradient w.r.t. log pi: (-A e^delta + 0.1 sign(delta) [penalised]) / 4."""
    loss, g, metrics = kl_cov(ratio, DELTA)
    expected_loss = sum(-a * math.exp(d) + (0.1 * abs(d) if i in penalised else 0.0)
                        for i, (a, d) in enumerate(zip(A, DELTA))) / 4
    assert loss == pytest.approx(expected_loss)
    assert g == pytest.approx([(-a * math.exp(d) + (0.1 * math.copysign(1, d) if i in penalised else 0.0)) / 4
                               for i, (a, d) in enumerate(zip(A, DELTA))])
    assert metrics["actor/ppo_kl"] == pytest.approx(sum(abs(d) for d in DELTA) / 4)


def test_cov_ratios_must_be_positive():
    old, log_prob, adv, mask = make()
    for mode, key in [("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio")]:
        with pytest.raises(ValueError, match=f"actor.policy_loss.{key} must be > 0"):
            get_policy_loss_fn(mode)(old, log_prob, adv, mask, "token-mean", {"policy_loss": {key: -1.0}})
