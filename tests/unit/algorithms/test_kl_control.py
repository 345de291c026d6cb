"""The adaptive KL controller follows Ziegler et al. 2019 (arXiv:1909.08593, sec. 2.2)
on the SEQUENCE KL; get_kl_controller takes verl's config object (and the older separate arguments)."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.algorithms import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller, sequence_kl


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
