"""Hand-computed checks of the registered policy losses (verl calling convention) and their registry.

Shared inputs (old_log_prob = 0, so log r = log_prob): two responses of UNEQUAL length,
    row 0: log_prob [0.1, 0.3, pad], A = +1 on both tokens
    row 1: log_prob [0.0, -0.3, 0.0], A = -0.5 on all three tokens
Every expected number is derived in the test's docstring with plain math.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.algorithms import (
    POLICY_LOSS_REGISTRY,
    ConfigOverlay,
    compute_policy_loss,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)

NAN = float("nan")


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def inputs():
    log_prob = torch.tensor([[0.1, 0.3, NAN], [0.0, -0.3, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, NAN], [0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, NAN], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    return old, log_prob, adv, mask


def run(mode, config=None, agg="token-mean"):
    old, log_prob, adv, mask = inputs()
    loss, metrics = get_policy_loss_fn(mode)(old, log_prob, adv, mask, agg, config)
    loss.backward()
    return loss.item(), log_prob.grad, metrics


def grad(rows):
    return torch.tensor(rows, dtype=torch.float64)


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


def test_rollout_is_weights_scale_token_losses():
    """vanilla, A = 1, r = 1: token loss -1; weights [2, 0.5] -> token-mean (-2 - 0.5) / 2 = -1.25."""
    z = torch.zeros(1, 2)
    loss, _ = compute_policy_loss_vanilla(z, z, torch.ones(1, 2), torch.ones(1, 2), "token-mean", None,
                                          rollout_is_weights=torch.tensor([[2.0, 0.5]]))
    assert loss.item() == pytest.approx(-1.25)


def test_config_overlay_adds_global_batch_info():
    """token-mean with batch_num_tokens = 10 (the whole mini-batch) and dp 2: sum / 10 * 2.
    GPG on row 0 only: sum = -0.4 -> -0.08."""
    old, log_prob, adv, mask = inputs()
    cfg = ConfigOverlay(OmegaConf.create({"clip_ratio": 0.2}),
                        global_batch_info={"dp_size": 2, "batch_num_tokens": 10, "global_batch_size": 4})
    loss, _ = get_policy_loss_fn("gpg")(old[:1], log_prob[:1], adv[:1], mask[:1], "token-mean", cfg)
    assert loss.item() == pytest.approx(-0.4 / 10 * 2)
    assert cfg.clip_ratio == 0.2 and cfg.get("missing", 7) == 7
    with pytest.raises(AttributeError):
        cfg.clip_ratio = 0.3


def test_policy_loss_registry():
    assert set(POLICY_LOSS_REGISTRY) >= {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"}
    assert get_policy_loss_fn("clip-cov") is get_policy_loss_fn("clip_cov")  # verl's docs spell it with '-'
    with pytest.raises(ValueError, match=r"'ppo3'.*'cispo'"):
        get_policy_loss_fn("ppo3")
    with pytest.raises(ValueError, match="override=True"):
        register_policy_loss("vanilla")(lambda *a: None)

    def mine(*args, **kwargs):
        return torch.tensor(1.0), {}

    try:
        register_policy_loss("my_loss")(mine)
        register_policy_loss("my_loss")(mine)  # same function twice: no-op
        assert get_policy_loss_fn("my_loss") is mine
    finally:
        POLICY_LOSS_REGISTRY.pop("my_loss", None)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "sapo", "gpg", "cispo", "geo_mean", "clip_cov", "kl_cov"])
def test_every_loss_ignores_padding_values_and_checks_shapes(mode):
    old, log_prob, adv, mask = inputs()
    fn = get_policy_loss_fn(mode)
    loss, _ = fn(old, log_prob, adv, mask, "token-mean", {"policy_loss": {"clip_cov_ratio": 0.5}})
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(log_prob.grad).all()
    assert log_prob.grad[0, 2] == 0
    with pytest.raises(ValueError, match="shape mismatch"):
        fn(old, log_prob, adv[:, :2], mask, "token-mean", None)
