"""What every registered policy loss shares (verl calling convention): rollout IS weights, the
ConfigOverlay's global batch info, padding values never leaking, shape checks.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.algorithms import ConfigOverlay, compute_policy_loss_vanilla, get_policy_loss_fn
from tests.unit.algorithms.helpers import inputs


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
