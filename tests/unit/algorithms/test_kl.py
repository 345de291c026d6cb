"""KL penalties (rlhf/algorithms/kl.py): the estimators k1 / abs / k2 / k3 and their straight-through "+"
variants by hand, the controllers, and the in-reward penalty.  The adaptive KL controller follows Ziegler
et al. 2019 (arXiv:1909.08593, sec. 2.2) on the SEQUENCE KL; get_kl_controller takes verl's config object
(and the older separate arguments).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
    sequence_kl,
)
from tests.unit.algorithms.helpers import NAN, t


# ----------------------------------------------------------------- KL estimators

LOGP = [-1.0, -2.0]
REF = [-1.5, -1.0]  # log_ratio = logp - ref = [0.5, -1.0]


def _kl_and_grad(mode):
    logprob = t(LOGP).requires_grad_()
    value = kl_penalty(logprob, t(REF), mode)
    value.sum().backward()
    return value.detach(), logprob.grad


def test_get_kl_controller_from_verl_config_and_old_arguments():
    for cfg in ({"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0, "horizon": 10000},
                OmegaConf.create({"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0, "horizon": 10000}),
                SimpleNamespace(type="adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000)):
        ctrl = get_kl_controller(cfg)
        assert isinstance(ctrl, AdaptiveKLController) and (ctrl.value, ctrl.target, ctrl.horizon) == (0.2, 6.0, 1e4)
    fixed = get_kl_controller({"type": "fixed", "kl_coef": 0.05})
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    assert get_kl_controller("adaptive", 0.2, 6.0, 100).target == 6.0  # older call, still used by callers
    with pytest.raises(ValueError, match="'pid'"):
        get_kl_controller({"type": "pid"})
    with pytest.raises(ValueError, match="horizon must be > 0"):
        get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 1.0, "horizon": 0})


def test_sequence_kl_sums_valid_tokens():
    kld = torch.tensor([[0.1, 0.2, 5.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(sequence_kl(kld, mask), torch.tensor([0.3, 0.3]))


def test_beta_grows_when_the_sequence_kl_is_above_target_though_the_token_kl_is_below():
    """Two responses of 100 tokens with log pi_old - log pi_ref = 0.01 nats per token (k1):
    token-mean KL 0.01, sequence KL 1.0; target 0.5, horizon 10, n_steps = bs = 2:
        e = clip(1.0 / 0.5 - 1, -0.2, 0.2) = 0.2 -> beta = 0.1 * (1 + 0.2 * 2 / 10) = 0.104  (grows)
    Fed the token-mean KL (verl) it would shrink: e = clip(0.01 / 0.5 - 1) = -0.2 -> 0.096."""
    old, ref = torch.full((2, 100), -1.0), torch.full((2, 100), -1.01)
    mask, scores = torch.ones(2, 100), torch.zeros(2, 100)
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    assert ctrl.value == pytest.approx(0.104)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.01, rel=1e-4)
    assert metrics["actor/reward_kl_penalty_seq"] == pytest.approx(1.0, rel=1e-4)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the beta applied to these rewards
    torch.testing.assert_close(rewards, torch.full((2, 100), -0.1 * 0.01), rtol=1e-4, atol=1e-9)


def test_beta_shrinks_when_the_sequence_kl_is_below_target():
    """Sequence KL 1.0 (same batch) with target 2.0: e = clip(0.5 - 1) = -0.2 -> 0.1 * (1 - 0.04) = 0.096."""
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=2.0, horizon=10)
    apply_kl_penalty(torch.zeros(2, 100), torch.full((2, 100), -1.0), torch.full((2, 100), -1.01),
                     torch.ones(2, 100), ctrl)
    assert ctrl.value == pytest.approx(0.096)


@pytest.mark.parametrize("mode", ["kl", "k1"])
def test_k1_value_and_unit_gradient(mode):
    value, grad = _kl_and_grad(mode)
    torch.testing.assert_close(value, t([0.5, -1.0]))
    torch.testing.assert_close(grad, t([1.0, 1.0]))


def test_abs_value_and_sign_gradient():
    value, grad = _kl_and_grad("abs")
    torch.testing.assert_close(value, t([0.5, 1.0]))
    torch.testing.assert_close(grad, t([1.0, -1.0]))


@pytest.mark.parametrize("mode", ["mse", "k2"])
def test_k2_value_and_gradient_is_log_ratio(mode):
    value, grad = _kl_and_grad(mode)
    torch.testing.assert_close(value, t([0.5 * 0.5**2, 0.5 * 1.0**2]))
    torch.testing.assert_close(grad, t([0.5, -1.0]))


@pytest.mark.parametrize("mode", ["low_var_kl", "k3"])
def test_k3_value_and_gradient(mode):
    value, grad = _kl_and_grad(mode)
    # k3 = exp(ref - logp) - (ref - logp) - 1, with ref - logp = [-0.5, 1.0]
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(value, t(expected))
    torch.testing.assert_close(grad, t([1 - math.exp(-0.5), 1 - math.exp(1.0)]))


def test_k3_is_clamped_to_ten():
    value = kl_penalty(t([0.0, 0.0]), t([15.0, -30.0]), "k3")
    torch.testing.assert_close(value, t([10.0, 10.0]))


@pytest.mark.parametrize("mode,forward", [("k3+", [math.exp(-0.5) - 0.5, math.exp(1.0) - 2]), ("kl+", [0.5, -1.0])])
def test_straight_through_variant_has_k2_gradient(mode, forward):
    value, grad = _kl_and_grad(mode)
    torch.testing.assert_close(value, t(forward))
    torch.testing.assert_close(grad, t([0.5, -1.0]))


def test_kl_penalty_errors():
    with pytest.raises(NotImplementedError):
        kl_penalty(t(LOGP), t(REF), "full")
    with pytest.raises(ValueError, match="'k9'"):
        kl_penalty(t(LOGP), t(REF), "k9")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_penalty(t(LOGP), t([1.0]), "kl")


# ----------------------------------------------------------------- KL controllers

def test_adaptive_controller_update_numbers():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2 -> x(1 + 0.2 * 256 / 10000)
    assert ctrl.value == pytest.approx(0.1 * 1.00512)
    ctrl.update(current_kl=5.4, n_steps=512)  # error 5.4/6 - 1 = -0.1 -> x(1 - 0.1 * 512 / 10000)
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.99488)
    ctrl.update(current_kl=0.0, n_steps=100)  # error -1 clipped to -0.2 -> x(1 - 0.2 * 100 / 10000)
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.99488 * 0.998)


def test_fixed_controller_never_changes():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_controllers_state_dict_round_trip():
    ctrl = AdaptiveKLController(0.1, 6.0, 10000)
    ctrl.update(9.0, 256)
    restored = AdaptiveKLController(0.5, 1.0, 1.0)
    restored.load_state_dict(ctrl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctrl.value, 6.0, 10000.0)
    fixed = FixedKLController(0.0)
    fixed.load_state_dict(FixedKLController(0.3).state_dict())
    assert fixed.value == 0.3


def test_get_kl_controller():
    assert isinstance(get_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    adaptive = get_kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=0)
    with pytest.raises(ValueError, match="'pid'"):
        get_kl_controller("pid", kl_coef=0.2)


# ----------------------------------------------------------------- apply_kl_penalty

def test_apply_kl_penalty_values_metrics_and_controller_update():
    scores = t([[0.0, 0.0, 1.0, 7.0], [0.0, 2.0, 7.0, 7.0]])
    old = t([[-1.0, -2.0, -0.5, NAN], [-1.0, -1.0, NAN, 9.0]])
    ref = t([[-1.5, -1.0, -0.5, 5.0], [-2.0, -1.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    # k1 per token: row0 [0.5, -1, 0], row1 [1, 0]; beta = 0.1
    expected = t([[-0.05, 0.1, 1.0, 7.0], [-0.1, 2.0, 7.0, 7.0]])
    torch.testing.assert_close(rewards, expected)
    # per-sequence mean KL: row0 -1/6, row1 1/2 -> batch mean 1/6
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(1 / 6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # error 1/6 - 1 = -5/6 clipped to -0.2, n_steps = bs = 2
    assert ctrl.value == pytest.approx(0.1 * (1 - 0.2 * 2 / 100))
