"""Rollout correction (rlhf.algorithms.rollout_corr, rollout_rs, policy_losses.bypass) against hand-computed values
and against verl's own functions (fixtures/rollout_corr_verl.json: verl's rollout_corr_helper, bypass-mode loss and
calculate_debug_metrics run on the same inputs by tests/support/rollout_corr_verl_fixture.py)."""
import json
import math

import pytest
import torch

from rlhf.algorithms.policy_losses.bypass import compute_policy_loss_bypass_mode
from rlhf.algorithms.rollout_corr import (calculate_debug_metrics, compute_offpolicy_metrics,
                                          compute_rollout_correction_and_rejection_mask,
                                          compute_rollout_correction_weights)
from rlhf.algorithms.rollout_rs import compute_rollout_rejection_mask
from tests.support.paths import REPO

FIXTURE = json.loads((REPO / "tests" / "support" / "fixtures" / "rollout_corr_verl.json").read_text())


def _fixture_inputs():
    t = {k: torch.tensor(FIXTURE[k]) for k in ("old_log_probs", "rollout_log_probs", "response_mask")}
    return t["old_log_probs"], t["rollout_log_probs"], t["response_mask"]


def test_token_is_weights_and_metrics_by_hand():
    # two sequences; log ratios 0.5, -1.0 | 2.0 (padding after); threshold 2
    old = torch.tensor([[0.5, -1.0], [2.0, 0.0]]) - 1.0
    rollout = torch.full((2, 2), -1.0)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w, m = compute_rollout_correction_weights(old - rollout, mask, "token", 2.0)
    e = [math.exp(0.5), math.exp(-1.0), math.exp(2.0)]
    assert torch.allclose(w, torch.tensor([[e[0], e[1]], [2.0, 0.0]]))
    assert m["rollout_is_mean"] == pytest.approx(sum(e) / 3)  # before truncation
    assert m["rollout_is_max"] == pytest.approx(e[2]) and m["rollout_is_min"] == pytest.approx(e[1])
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # e^2 > 2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)  # e^-1 < 1/2
    clamped = [e[0], 0.5, 2.0]  # clamped to [1/2, 2] for std and ESS
    mean = sum(clamped) / 3
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(sum(c * c for c in clamped) / 3 - mean ** 2), rel=1e-5)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / (sum((c / mean) ** 2 for c in clamped) / 3), rel=1e-5)
    assert m["rollout_is_seq_mean"] == pytest.approx(((e[0] + e[1]) / 2 + e[2]) / 2)


def test_sequence_is_weight_is_the_truncated_product():
    log_ratio = torch.tensor([[0.2, 0.3, 9.0], [-0.1, -0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, m = compute_rollout_correction_weights(log_ratio, mask, "sequence", 5.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.5)] * 2 + [0.0])  # the padded 9.0 does not count
    assert w[1].tolist() == pytest.approx([math.exp(-0.3)] * 3)
    wn, mn = compute_rollout_correction_weights(log_ratio, mask, "sequence", 5.0, rollout_is_batch_normalize=True)
    factor = (math.exp(0.5) + math.exp(-0.3)) / 2
    assert mn["rollout_is_batch_norm_factor"] == pytest.approx(factor)
    assert wn[1, 0].item() == pytest.approx(math.exp(-0.3) / factor)


def test_rejection_k1_token_and_sequence_by_hand():
    log_ratio = torch.tensor([[0.1, -0.9, 0.0], [0.05, 0.05, 0.05]])  # k1 = -log_ratio
    mask = torch.ones(2, 3)
    kept, m = compute_rollout_rejection_mask(log_ratio, mask, "token_k1", "0.5_2.0")  # keep k1 in [log .5, log 2]
    assert kept.tolist() == [[1, 0, 1], [1, 1, 1]]  # k1 = 0.9 > log 2 = 0.693
    assert m["rollout_rs_masked_fraction"] == pytest.approx(1 / 6)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    kept, m = compute_rollout_rejection_mask(log_ratio, mask, "seq_sum_k2", 0.3)  # sum of r^2/2: .41, .00375
    assert kept.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert m["rollout_rs_seq_sum_k2_max"] == pytest.approx(0.5 * (0.01 + 0.81))


def test_offpolicy_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-1.5, -1.0]])
    m = compute_offpolicy_metrics(old, rollout, torch.ones(1, 2))
    assert m["kl"] == pytest.approx(((-1.5 + 1.0) + (-1.0 + 2.0)) / 2)
    assert m["training_ppl"] == pytest.approx(math.exp(1.5)) and m["rollout_ppl"] == pytest.approx(math.exp(1.25))
    r = [0.5, -1.0]
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in r) / 2)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in r) / 2 - 1)
    assert m["chi2_seq"] == pytest.approx(math.exp(2 * sum(r)) - 1)
    assert m["log_ppl_diff"] == pytest.approx(-1.25 + 1.5)


@pytest.mark.parametrize("case", range(len(FIXTURE["cases"])))
def test_matches_verls_rollout_corr_helper(case):
    c = FIXTURE["cases"][case]
    old, rollout, mask = _fixture_inputs()
    weights, kept, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **c["kwargs"])
    assert set(metrics) == set(c["metrics"])
    for k, v in c["metrics"].items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert kept.tolist() == c["mask"]
    assert (weights is None) == (c["weights"] is None)
    if weights is not None:
        assert torch.allclose(weights, torch.tensor(c["weights"]), rtol=1e-6, atol=1e-7)


def test_fixture_rejects_something():
    """The verl cases exercise rejection: some tokens and some sequences are masked."""
    fractions = [c["metrics"].get("rollout_corr/rollout_rs_masked_fraction", 0.0) for c in FIXTURE["cases"]]
    assert any(0 < f < 1 for f in fractions)


def test_mismatch_metrics_match_verls_calculate_debug_metrics():
    old, rollout, mask = _fixture_inputs()
    got = calculate_debug_metrics(old, rollout, mask)
    assert got == pytest.approx(FIXTURE["debug_metrics"], rel=1e-5)


@pytest.mark.parametrize("case", range(len(FIXTURE["bypass"])))
def test_bypass_loss_matches_verl(case):
    c = FIXTURE["bypass"][case]
    old, rollout, mask = _fixture_inputs()
    cfg = {"policy_loss": {"rollout_correction": c["rc"]}, "clip_ratio": 0.2, "clip_ratio_low": 0.2,
           "clip_ratio_high": 0.28}
    loss, metrics = compute_policy_loss_bypass_mode(rollout, old, torch.tensor(FIXTURE["advantages"]), mask, c["agg"],
                                                    cfg)
    assert loss.item() == pytest.approx(c["loss"], rel=1e-6)
    for k, v in c["metrics"].items():
        assert float(metrics[k]) == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_bad_settings_raise_with_verls_messages():
    lr, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="Invalid rollout_is: tok"):
        compute_rollout_correction_weights(lr, mask, "tok")
    with pytest.raises(ValueError, match="Invalid rollout_rs option: token_k4"):
        compute_rollout_rejection_mask(lr, mask, "token_k4", 1.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold must be explicitly provided"):
        compute_rollout_correction_and_rejection_mask(lr, lr, mask, rollout_rs="token_k1")
    with pytest.raises(ValueError, match="single upper bound"):
        compute_rollout_rejection_mask(lr, mask, "token_k2", "0.1_2")


def test_config_check_names_the_keys():
    from rlhf.config.schema.run import RolloutCorrectionConfig

    assert RolloutCorrectionConfig().problems("algorithm.rollout_correction.") == []
    rc = RolloutCorrectionConfig()  # (the constructor raises on bad values: set them afterwards)
    object.__setattr__(rc, "rollout_is", "tokens")
    object.__setattr__(rc, "rollout_rs", "seq_sum_k1")
    problems = rc.problems("algorithm.rollout_correction.")
    assert problems[0] == "algorithm.rollout_correction.rollout_is='tokens' must be null, token or sequence."
    assert "rollout_rs_threshold must be provided" in problems[1] and "algorithm.rollout_correction.rollout_rs=" \
        in problems[1]
