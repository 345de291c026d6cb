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


# ---- rejection with GAE (verl applies the rejection to response_mask before compute_advantage) ----------------
def _gae_case(rs, threshold, rejected_value=9.0, rejected_old=-0.2):
    """Sample 1 [3 tokens, score 1 on the last], sample 2 [2 tokens, score -1]; log ratio old - rollout is 0 but
    on sample 1's middle token (`rejected_old` + 1.2: 1.0 by default).  Returns the batch after the trainer's
    apply_rollout_correction + compute_advantages (gamma 1, lam 0.5) and the config."""
    from rlhf.trainer.advantages import compute_advantages
    cfg = _cfg("algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.5",
               f"algorithm.rollout_correction.rollout_rs={rs}",
               f"algorithm.rollout_correction.rollout_rs_threshold={threshold}")
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = {"old_log_probs": torch.tensor([[-1.0, rejected_old, -1.0], [-1.0, -1.0, 0.0]]),
             "rollout_log_probs": torch.tensor([[-1.0, -1.2, -1.0], [-1.0, -1.0, 0.0]]),
             "values": torch.tensor([[0.5, rejected_value, 0.25], [0.0, 0.5, 0.0]]),
             "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]]),
             "response_mask": mask, "loss_mask": mask.clone(), "sample_valid": torch.ones(2, dtype=torch.bool)}
    apply_rollout_correction(batch, cfg.algorithm.rollout_correction)
    compute_advantages(batch, __import__("numpy").arange(2), cfg.algorithm, None)
    return batch, cfg


def _whiten(xs):
    import statistics
    mean, std = statistics.fmean(xs), statistics.stdev(xs)  # verl's masked_whiten: unbiased variance
    return [(x - mean) / std for x in xs]


def test_token_rejection_with_gae_skips_the_rejected_token_by_hand():
    batch, _ = _gae_case("token_k1", "0.5_2.0")
    assert batch["loss_mask"].tolist() == [[1, 0, 1], [1, 1, 0]]
    # GAE over the kept tokens, the rejected one skipped like an observation token (its value 9 never used):
    # sample 1: A_2 = 1 - 0.25 = 0.75; A_0 = (0 + V_2 - V_0) + 0.5 A_2 = -0.25 + 0.375 = 0.125
    # sample 2: A_1 = -1 - 0.5 = -1.5;  A_0 = (0 + 0.5 - 0) + 0.5 (-1.5) = -0.25
    assert batch["returns"][0, [0, 2]].tolist() == pytest.approx([0.625, 1.0])
    assert batch["returns"][1, :2].tolist() == pytest.approx([-0.25, -1.0])
    w = _whiten([0.125, 0.75, -0.25, -1.5])  # whitened over the 4 kept tokens only
    adv = batch["advantages"]
    assert [adv[0, 0].item(), adv[0, 2].item(), adv[1, 0].item(), adv[1, 1].item()] == pytest.approx(w, abs=1e-5)


def test_rejected_tokens_contribute_nothing_to_the_gae_actor_and_critic_losses():
    """The rejected token's value, old log-prob and current log-prob changed: every kept token's advantage and
    return, the policy loss and the value loss stay the same."""
    from rlhf import algorithms as algos
    outs = []
    for rejected_value, rejected_old, current in ((9.0, -0.2, -0.7), (-3.0, -2.5, -4.0)):
        batch, cfg = _gae_case("token_k1", "0.5_2.0", rejected_value, rejected_old)
        assert batch["loss_mask"][0, 1] == 0
        log_prob = batch["old_log_probs"].clone() + 0.1
        log_prob[0, 1] = current
        full = torch.zeros(2, P + R)
        full[:, P:] = log_prob
        mb = {k: batch[k] for k in ("old_log_probs", "advantages", "response_mask", "loss_mask")}
        pg, _ = PPOPolicyLoss(cfg.actor)({"log_probs": full, "entropy": torch.zeros(2, P + R)}, mb, P)
        vpreds = batch["values"] + 0.3
        vpreds[0, 1] = 5 * rejected_value
        vf, _ = algos.compute_value_loss(vpreds, batch["returns"], batch["values"], batch["loss_mask"], 0.2)
        keep = batch["loss_mask"].bool()
        outs.append((batch["advantages"][keep], batch["returns"][keep], pg.item(), vf.item()))
    (a1, r1, pg1, vf1), (a2, r2, pg2, vf2) = outs
    assert torch.allclose(a1, a2) and torch.allclose(r1, r2)
    assert pg1 == pytest.approx(pg2, rel=1e-6) and vf1 == pytest.approx(vf2, rel=1e-6)


def test_sequence_rejection_with_gae_leaves_the_sequence_out_of_the_whitening():
    # seq_mean_k1: sample 1's mean k1 is -1/3, outside [log 0.8, log 1.25] = [-0.22, 0.22]; sample 2's is 0
    batch, _ = _gae_case("seq_mean_k1", "0.8_1.25")
    assert batch["loss_mask"].tolist() == [[0, 0, 0], [1, 1, 0]]
    assert batch["advantages"][0].tolist() == [0.0, 0.0, 0.0]
    assert batch["advantages"][1, :2].tolist() == pytest.approx(_whiten([-0.25, -1.5]), abs=1e-5)
