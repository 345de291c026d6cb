"""Hand-computed checks for masked ops, KL, controllers, loss aggregation,
policy / value / entropy losses and the DAPO helpers.

Expected numbers are worked out in comments or with plain python floats,
never by calling the function under test.
"""

import math
import statistics

import numpy as np
import pytest
import torch

from rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_entropy_loss,
    compute_overlong_penalty,
    compute_policy_loss,
    compute_value_loss,
    filter_groups_by_metric,
    get_kl_controller,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
)

NAN, INF = float("nan"), float("inf")


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


# ----------------------------------------------------------------- masked ops

VALUES = t([[1.0, 2.0, NAN], [4.0, INF, 6.0]])
MASK = t([[1, 1, 0], [1, 0, 1]])
VALID = [1.0, 2.0, 4.0, 6.0]


def test_masked_mean_ignores_nan_and_inf_padding():
    assert masked_mean(VALUES, MASK).item() == pytest.approx(13 / 4)
    torch.testing.assert_close(masked_mean(VALUES, MASK, axis=-1), t([1.5, 5.0]))


def test_masked_mean_of_empty_row_is_zero():
    row_means = masked_mean(t([[NAN, 1.0], [2.0, 4.0]]), t([[0, 0], [1, 1]]), axis=-1)
    torch.testing.assert_close(row_means, t([0.0, 3.0]))


def test_masked_mean_accepts_bool_mask():
    assert masked_mean(VALUES, MASK.bool()).item() == pytest.approx(3.25)


def test_masked_var_unbiased_and_biased():
    # mean 3.25; squared deviations 5.0625 + 1.5625 + 0.5625 + 7.5625 = 14.75
    assert masked_var(VALUES, MASK).item() == pytest.approx(14.75 / 3)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(14.75 / 4)
    assert masked_var(VALUES, MASK).item() == pytest.approx(statistics.variance(VALID))


def test_masked_var_needs_two_valid_entries():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(t([[1.0, 2.0]]), t([[1, 0]]))


def test_masked_whiten_uses_unbiased_std_and_zeroes_padding():
    mean, std = statistics.mean(VALID), statistics.stdev(VALID)
    expected = t([[(1 - mean) / std, (2 - mean) / std, 0.0], [(4 - mean) / std, 0.0, (6 - mean) / std]])
    torch.testing.assert_close(masked_whiten(VALUES, MASK), expected, atol=1e-7, rtol=1e-7)
    shifted = expected + mean * MASK
    torch.testing.assert_close(masked_whiten(VALUES, MASK, shift_mean=False), shifted, atol=1e-7, rtol=1e-7)


def test_masked_ops_reject_shape_mismatch():
    with pytest.raises(ValueError, match=r"values=\(2, 3\), mask=\(2, 2\)"):
        masked_mean(VALUES, MASK[:, :2])


# ----------------------------------------------------------------- KL estimators

LOGP = [-1.0, -2.0]
REF = [-1.5, -1.0]  # log_ratio = logp - ref = [0.5, -1.0]


def _kl_and_grad(mode):
    logprob = t(LOGP).requires_grad_()
    value = kl_penalty(logprob, t(REF), mode)
    value.sum().backward()
    return value.detach(), logprob.grad


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


# ----------------------------------------------------------------- agg_loss

LOSS = t([[1.0, 2.0, 3.0, NAN], [4.0, 5.0, 1e30, INF], [NAN, NAN, NAN, NAN]])
LOSS_MASK = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
EXPECTED_AGG = {
    "token-mean": 15 / 5,  # 1+2+3+4+5 over 5 tokens
    "seq-mean-token-sum": (6 + 9) / 2,  # the empty third row is excluded
    "seq-mean-token-mean": (2.0 + 4.5) / 2,
    # Dr.GRPO: token sums over a constant normaliser (response_length = 4), mean over the 2 non-empty rows
    "seq-mean-token-sum-norm": (6 / 4 + 9 / 4) / 2,
}


@pytest.mark.parametrize("mode", list(EXPECTED_AGG))
def test_agg_loss_values_ignore_padding(mode):
    assert agg_loss(LOSS, LOSS_MASK, mode).item() == pytest.approx(EXPECTED_AGG[mode])


@pytest.mark.parametrize("mode", list(EXPECTED_AGG))
def test_agg_loss_invariant_to_padding_value(mode):
    results = []
    for pad in [0.0, -3.0, 1e30, NAN, INF]:
        loss = torch.where(LOSS_MASK.bool(), LOSS, torch.full_like(LOSS, pad))
        results.append(agg_loss(loss, LOSS_MASK, mode).item())
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("mode", list(EXPECTED_AGG))
def test_agg_loss_all_masked_is_zero_not_nan(mode):
    assert agg_loss(LOSS, torch.zeros_like(LOSS_MASK), mode).item() == 0.0


def test_agg_loss_gradient_weights():
    finite = torch.where(LOSS_MASK.bool(), LOSS, torch.full_like(LOSS, 1e30)).requires_grad_()
    agg_loss(finite, LOSS_MASK, "seq-mean-token-mean").backward()
    # each of the 2 non-empty rows weighs 1/2, split over its 3 resp. 2 tokens
    expected = t([[1 / 6, 1 / 6, 1 / 6, 0], [1 / 4, 1 / 4, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(finite.grad, expected)


def test_agg_loss_dr_grpo_custom_normaliser_and_errors():
    assert agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="'token_sum'"):  # a misspelt mode is named
        agg_loss(LOSS, LOSS_MASK, "token_sum")
    with pytest.raises(ValueError, match="shape mismatch"):
        agg_loss(LOSS, LOSS_MASK[:2], "token-mean")


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


# ----------------------------------------------------------------- value / entropy loss

def test_value_loss_clip_by_hand():
    # old values 1.0, clip 0.2 -> vpred clipped into [0.8, 1.2]
    #  vpred 1.5, ret 2.0: (1.5-2)^2 = 0.25 vs (1.2-2)^2 = 0.64 -> 0.64 (clipped term wins)
    #  vpred 0.9, ret 0.0: 0.81 vs 0.81 -> 0.81
    #  vpred 2.0, ret 1.0: 1.00 vs (1.2-1)^2 = 0.04 -> 1.00
    vpreds = t([[1.5, 0.9, 2.0, NAN]]).requires_grad_()
    returns = t([[2.0, 0.0, 1.0, NAN]])
    values = t([[1.0, 1.0, 1.0, NAN]])
    mask = t([[1, 1, 1, 0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 1.0) / 3)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)
    vf_loss.backward()
    # 0.5 * d(vpred - ret)^2 / 3 tokens = (vpred - ret) / 3 where unclipped; 0 where clipped or padded
    torch.testing.assert_close(vpreds.grad, t([[0.0, 0.9 / 3, 1.0 / 3, 0.0]]))


def test_entropy_loss_from_logits_aggregation():
    """verl's signature: compute_entropy_loss(logits (bs, L, V), mask, mode).
    H([0, 0]) = H([5, 5]) = ln 2; H([0, ln 3]) = H(1/4, 3/4) = -(1/4 ln 1/4 + 3/4 ln 3/4); NaN padding ignored."""
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    logits = t([[[0.0, 0.0], [0.0, math.log(3)], [NAN, NAN]], [[5.0, 5.0], [NAN, INF], [NAN, NAN]]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert compute_entropy_loss(logits, mask, "token-mean").item() == pytest.approx((2 * math.log(2) + h) / 3)
    assert compute_entropy_loss(logits, mask, "seq-mean-token-mean").item() == pytest.approx(
        ((math.log(2) + h) / 2 + math.log(2)) / 2)
    with pytest.raises(ValueError, match="agg_loss"):
        compute_entropy_loss(t([[1.0, 2.0]]), t([[1, 1]]))


# ----------------------------------------------------------------- DAPO helpers

def test_overlong_penalty_documented_values():
    # L_max = 20, buffer 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    expected = t([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0], torch.float32)
    torch.testing.assert_close(compute_overlong_penalty(lengths, 20, 4, 1.0), expected)
    torch.testing.assert_close(compute_overlong_penalty(lengths, 20, 4, 0.5), expected * 0.5)


def test_overlong_penalty_validation():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        compute_overlong_penalty(torch.tensor([1]), 20, 0, 1.0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        compute_overlong_penalty(torch.tensor([1]), 20, 21, 1.0)
    with pytest.raises(ValueError, match=r"\(batch,\)"):
        compute_overlong_penalty(torch.tensor([[1]]), 20, 4, 1.0)


def test_filter_groups_keeps_only_groups_with_varied_metric():
    metric = [1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0]
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d"], dtype=object)
    kept = filter_groups_by_metric(metric, index)
    assert kept.tolist() == [False, False, False, True, True, True, False, False]
    kept = filter_groups_by_metric(torch.tensor(metric), list(index), keep_singleton_groups=False)
    assert kept.tolist() == [False, False, False, True, True, False, False, False]


def test_filter_groups_exact_equality_despite_round_off():
    # mean of three 0.1s is not exactly 0.1 in floating point; the group must still be dropped
    kept = filter_groups_by_metric([0.1, 0.1, 0.1, 0.1, 0.2], [0, 0, 0, 1, 1])
    assert kept.tolist() == [False, False, False, True, True]
    with pytest.raises(ValueError, match="index has 2 entries"):
        filter_groups_by_metric([0.1, 0.2, 0.3], [0, 0])


def test_filter_groups_refuses_non_finite_metric():
    """A NaN metric would drop its group silently (NaN > NaN is False); it is refused, naming the sample."""
    with pytest.raises(ValueError, match=r"non-finite at sample\(s\) \[2\]"):
        filter_groups_by_metric([1.0, 0.0, NAN, 1.0], [0, 0, 1, 1])
