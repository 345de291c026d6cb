"""PPOPolicyLoss with ``algorithm.rollout_correction`` (rlhf.workers.losses) and the trainer's batch step
(rlhf.trainer.advantages.apply_rollout_correction): IS weights multiply the per-token loss, rejection leaves the
loss mask, bypass mode trains against the engine's log-probs, the actor reports rollout_corr/ metrics."""
import math

import pytest
import torch

from rlhf.config import compose_config
from rlhf.trainer.advantages import apply_rollout_correction, mismatch_metrics
from rlhf.workers.losses import PPOPolicyLoss

P, R = 2, 3


def _mb(weights=None):
    g = torch.Generator().manual_seed(3)
    log_prob = -torch.rand(2, R, generator=g) - 0.5
    mb = {"old_log_probs": log_prob + 0.05, "rollout_log_probs": log_prob - 0.1,
          "advantages": torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]]),
          "response_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])}
    mb["loss_mask"] = mb["response_mask"].clone()
    if weights is not None:
        mb["rollout_is_weights"] = weights * mb["response_mask"]
    full = torch.zeros(2, P + R)
    full[:, P:] = log_prob
    outs = {"log_probs": full, "entropy": torch.zeros(2, P + R)}
    return outs, mb, log_prob


def _cfg(*overrides):
    return compose_config(["actor.entropy_coeff=0", *overrides])


def test_is_weights_multiply_the_per_token_loss():
    cfg = _cfg("algorithm.rollout_correction.rollout_is=token")
    plain = PPOPolicyLoss(cfg.actor)
    weighted = PPOPolicyLoss(cfg.actor, rollout_correction=cfg.algorithm.rollout_correction)
    assert "rollout_is_weights" in weighted.keys and "rollout_log_probs" in weighted.keys
    outs, mb, log_prob = _mb(weights=torch.full((2, R), 2.0))
    base, _ = plain(outs, mb, P)
    loss, metrics = weighted(outs, mb, P)
    assert loss.item() == pytest.approx(2 * base.item(), rel=1e-6)
    # verl's actor: the current policy against the engine, per micro batch
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.1, rel=1e-5)  # mean of log p_rollout - log p
    assert metrics["rollout_corr/training_ppl"] > 1


def test_bypass_mode_trains_against_the_engine_log_probs():
    cfg = _cfg("algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce")
    loss_fn = PPOPolicyLoss(cfg.actor, rollout_correction=cfg.algorithm.rollout_correction)
    assert loss_fn.loss_mode == "bypass_mode" and "rollout_log_probs" not in loss_fn.keys
    outs, mb, log_prob = _mb()
    mb["old_log_probs"] = mb["rollout_log_probs"]  # what the trainer does in bypass mode
    loss, metrics = loss_fn(outs, mb, P)
    # reinforce without IS weights, token-mean: -mean(A * log p) over the 5 tokens
    expected = -(mb["advantages"] * log_prob * mb["response_mask"]).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.1, rel=1e-5)


def test_apply_rollout_correction_fills_weights_and_rejects_from_the_loss_mask():
    cfg = _cfg("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=1.5",
               "algorithm.rollout_correction.rollout_rs=token_k1",
               "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0")
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = {"old_log_probs": torch.tensor([[-1.0, -0.2, -1.0], [-1.0, -1.0, 0.0]]),
             "rollout_log_probs": torch.tensor([[-1.0, -1.2, -0.1], [-1.3, -1.0, 0.0]]),
             "response_mask": mask, "loss_mask": mask * torch.tensor([[1.0], [0.0]])}  # sample 2 excluded already
    metrics = apply_rollout_correction(batch, cfg.algorithm.rollout_correction)
    # log ratios 0, 1.0, -0.9 | 0.3, 0: weights 1, min(e, 1.5), e^-0.9 | e^0.3, 1
    want = torch.tensor([[1.0, 1.5, math.exp(-0.9)], [math.exp(0.3), 1.0, 0.0]])
    assert torch.allclose(batch["rollout_is_weights"], want)
    # k1 = -log ratio outside [log .5, log 2] = [-0.69, 0.69]: token 2 (k1 -1.0) and token 3 (k1 0.9) of sample 1
    assert batch["loss_mask"].tolist() == [[1, 0, 0], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert "rollout_corr/kl" in metrics and set(mismatch_metrics(batch)) == {
        "training/rollout_probs_diff_valid", "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr"}
