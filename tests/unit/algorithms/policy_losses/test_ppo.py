"""PPO-style ratio surrogates (rlhf/algorithms/policy_losses/ppo.py) by hand: clip and dual clip, the
decoupled (clip-higher) ranges, verl's 4-tuple compute_policy_loss and the registered ``vanilla``, SAPO.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.algorithms import compute_policy_loss, compute_policy_loss_vanilla
from tests.unit.algorithms.helpers import NAN, grad, run, sigmoid, t


# ----------------------------------------------------------------- policy loss

def _reference_pg_token_loss(adv, ratio, low, high, c):
    """Plain-python PPO token loss with dual clip."""
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    return min(loss, -adv * c) if adv < 0 else loss


def test_policy_loss_clip_and_dual_clip_by_hand():
    # token: (advantage, ratio) -> per-token loss with eps = 0.2, c = 3
    #  (+1, 1.5): max(-1.5, -1.2) = -1.2   ratio clipped
    #  (+1, 0.5): max(-0.5, -0.8) = -0.5
    #  (-1, 0.5): max( 0.5,  0.8) =  0.8   ratio clipped
    #  (-1, 5.0): max( 5.0,  1.2) =  5.0 -> dual clip min(5, 3) = 3
    #  (-2, 1.1): 2.2 either way
    ratios = [1.5, 0.5, 0.5, 5.0, 1.1]
    advantages = t([[1.0, 1.0, -1.0, -1.0, -2.0, NAN]])
    old = t([[-1.0] * 6])
    log_prob = (old + t([[math.log(r) for r in ratios] + [NAN]])).requires_grad_()
    mask = t([[1, 1, 1, 1, 1, 0]])
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old, log_prob, advantages, mask, cliprange=0.2, clip_ratio_c=3.0
    )
    assert pg_loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0 + 2.2) / 5)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert clipfrac_lower.item() == pytest.approx(1 / 5)
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in ratios) / 5)
    pg_loss.backward()
    # d loss / d log_prob = -A * ratio / 5 for unclipped tokens, 0 where a clip is active
    expected_grad = t([[0.0, -0.5 / 5, 0.0, 0.0, 2.2 / 5, 0.0]])
    torch.testing.assert_close(log_prob.grad, expected_grad)


def test_policy_loss_decoupled_clip_range():
    # clip_low = 0.2, clip_high = 0.28 (DAPO clip-higher)
    #  (+1, 1.25): inside [0.8, 1.28] -> -1.25 (symmetric 0.2 would give -1.2)
    #  (+1, 1.40): clipped at 1.28   -> -1.28
    #  (-1, 0.70): clipped at 0.8    ->  0.8
    ratios, adv = [1.25, 1.4, 0.7], [1.0, 1.0, -1.0]
    old = t([[0.0, 0.0, 0.0]])
    log_prob = t([[math.log(r) for r in ratios]])
    pg_loss, clipfrac, _, _ = compute_policy_loss(
        old, log_prob, t([adv]), t([[1, 1, 1]]), cliprange=0.2, cliprange_low=0.2, cliprange_high=0.28
    )
    assert pg_loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)


def test_policy_loss_matches_python_loop_on_random_inputs():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    log_prob = old + 0.6 * torch.randn(4, 7, generator=gen, dtype=torch.float64)
    adv = 2 * torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).double()
    low, high, c = 0.1, 0.3, 2.0
    pg_loss, *_ = compute_policy_loss(old, log_prob, adv, mask, cliprange_low=low, cliprange_high=high, clip_ratio_c=c)
    token_losses = [
        _reference_pg_token_loss(adv[i, j].item(), math.exp(log_prob[i, j].item() - old[i, j].item()), low, high, c)
        for i in range(4) for j in range(7) if mask[i, j] == 1
    ]
    assert pg_loss.item() == pytest.approx(sum(token_losses) / len(token_losses))


def test_policy_loss_validation():
    x = t([[0.0, 0.0]])
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_loss(x, x, x, x + 1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(x, x, x, x + 1, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"advantages=\(1, 1\)"):
        compute_policy_loss(x, x, x[:, :1], x + 1, cliprange=0.2)


def test_sapo_soft_gate():
    """SAPO: f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = 1 (A > 0) / 1.05 (A <= 0); token loss -f(r) A,
    seq-mean-token-mean.  d loss_t / d log_prob_t = -A * 4 sigmoid (1 - sigmoid) * r, then / |y_i| / 2."""
    tp, tn = 1.0, 1.05
    r0 = [math.exp(0.1), math.exp(0.3)]
    r1 = [1.0, math.exp(-0.3), 1.0]
    f = lambda r, tau: sigmoid(tau * (r - 1)) * 4 / tau  # noqa: E731
    row0 = sum(-f(r, tp) for r in r0) / 2
    row1 = sum(0.5 * f(r, tn) for r in r1) / 3
    loss, g, _ = run("sapo", {"tau_pos": tp, "tau_neg": tn})
    assert loss == pytest.approx((row0 + row1) / 2)
    dg = lambda r, tau, a: -a * 4 * sigmoid(tau * (r - 1)) * (1 - sigmoid(tau * (r - 1))) * r  # noqa: E731
    expected = [[dg(r, tp, 1.0) / 2 / 2 for r in r0] + [0.0], [dg(r, tn, -0.5) / 3 / 2 for r in r1]]
    torch.testing.assert_close(g, grad(expected))
    assert f(1.0, 2.0) == pytest.approx(1.0)  # on-policy value 2 / tau


def test_vanilla_matches_compute_policy_loss_and_reads_verl_fields():
    torch.manual_seed(0)
    old, new, adv = torch.randn(3, 4, 5).unbind(0)
    mask = (torch.rand(4, 5) > 0.3).float()
    expected, clipfrac, ppo_kl, lower = compute_policy_loss(old, new, adv, mask, cliprange_low=0.1, cliprange_high=0.3,
                                                            clip_ratio_c=2.5, loss_agg_mode="seq-mean-token-mean")
    cfg = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 2.5}
    for config in (cfg, OmegaConf.create(cfg), SimpleNamespace(**cfg)):
        loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, "seq-mean-token-mean", config)
        assert loss.item() == pytest.approx(expected.item())
        assert metrics == pytest.approx({"actor/pg_clipfrac": clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                                         "actor/pg_clipfrac_lower": lower.item()})
