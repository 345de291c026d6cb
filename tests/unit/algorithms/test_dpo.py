"""Hand-computed checks for the DPO / IPO / hinge preference losses."""

import math

import pytest
import torch

from rlhf.algorithms import compute_dpo_loss

# pair 0: policy chosen -10 / rejected -12, reference -11 / -11
#         h = (-10 + 11) - (-12 + 11) = 2,   beta * h = 0.2
# pair 1: policy chosen -5 / rejected -4, reference -5 / -5
#         h = 0 - 1 = -1,                    beta * h = -0.1
BETA = 0.1
INPUTS = dict(
    policy_chosen_logps=[-10.0, -5.0],
    policy_rejected_logps=[-12.0, -4.0],
    reference_chosen_logps=[-11.0, -5.0],
    reference_rejected_logps=[-11.0, -5.0],
)


def tensors(requires_grad=False):
    out = {k: torch.tensor(v, dtype=torch.float64) for k, v in INPUTS.items()}
    out["policy_chosen_logps"].requires_grad_(requires_grad)
    return out


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_sigmoid_dpo_loss_rewards_and_metrics():
    loss, chosen, rejected, metrics = compute_dpo_loss(**tensors(), beta=BETA)
    expected = (-log_sigmoid(0.2) - log_sigmoid(-0.1)) / 2  # (0.598139 + 0.744397) / 2
    assert loss.item() == pytest.approx(expected)
    torch.testing.assert_close(chosen, torch.tensor([0.1, 0.0], dtype=torch.float64))
    torch.testing.assert_close(rejected, torch.tensor([-0.1, 0.1], dtype=torch.float64))
    assert metrics["dpo/loss"] == pytest.approx(expected)
    assert metrics["dpo/reward_accuracy"] == 0.5
    assert metrics["dpo/reward_margin"] == pytest.approx((0.2 - 0.1) / 2)
    assert metrics["dpo/rewards_chosen"] == pytest.approx(0.05)
    assert metrics["dpo/rewards_rejected"] == pytest.approx(0.0)


def test_sigmoid_dpo_gradient():
    inputs = tensors(requires_grad=True)
    loss, chosen, *_ = compute_dpo_loss(**inputs, beta=BETA)
    loss.backward()
    # d/d pc of -log sigmoid(beta h) / N = -beta * (1 - sigmoid(beta h)) / N
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [-BETA * (1 - sigmoid(0.2)) / 2, -BETA * (1 - sigmoid(-0.1)) / 2]
    torch.testing.assert_close(inputs["policy_chosen_logps"].grad, torch.tensor(expected, dtype=torch.float64))
    assert not chosen.requires_grad


def test_policy_equal_to_reference_gives_log_two():
    logps = torch.tensor([-3.0, -7.0])
    loss, *_ = compute_dpo_loss(logps, logps * 2, logps, logps * 2, beta=0.5)
    assert loss.item() == pytest.approx(math.log(2))


def test_label_smoothing_conservative_dpo():
    loss, *_ = compute_dpo_loss(**tensors(), beta=BETA, label_smoothing=0.1)
    per_pair = [-0.9 * log_sigmoid(x) - 0.1 * log_sigmoid(-x) for x in (0.2, -0.1)]
    assert loss.item() == pytest.approx(sum(per_pair) / 2)


def test_ipo_loss_on_per_token_averaged_margin():
    """IPO (Azar et al. 2023, eq. 17): (h_avg - 1/(2 beta))^2 with the per-token-averaged margin
    h_avg = ratio_w / |y_w| - ratio_l / |y_l|; 1/(2 beta) = 5.
    pair 0: lengths 2 / 4: h_avg = 1/2 - (-1)/4 = 0.75 -> (0.75 - 5)^2 = 18.0625
    pair 1: lengths 1 / 1: h_avg = 0 - 1 = -1         -> (-1 - 5)^2   = 36"""
    lengths = dict(chosen_lengths=torch.tensor([2.0, 1.0], dtype=torch.float64),
                   rejected_lengths=torch.tensor([4.0, 1.0], dtype=torch.float64))
    loss, *_ = compute_dpo_loss(**tensors(), beta=BETA, loss_type="ipo", **lengths)
    assert loss.item() == pytest.approx((18.0625 + 36) / 2)


def test_ipo_long_pairs_keep_learning():
    """Per-token log-ratio +0.5 on the chosen and -0.5 on the rejected response, lengths 1 vs 100:
    h_avg = 1 in both cases, so the loss (1 - 5)^2 = 16 and the gradient per chosen token
    d/d(ratio_w) = 2 (h_avg - 5) / |y_w| * |y_w| per unit of per-token log-ratio are equal.
    On the summed margin the 100-token pair would give (100 - 5)^2: pushed the wrong way."""
    losses = []
    for n in (1, 100):
        chosen = torch.tensor([0.5 * n], dtype=torch.float64, requires_grad=True)
        loss, *_ = compute_dpo_loss(chosen, torch.tensor([-0.5 * n], dtype=torch.float64),
                                    torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                                    beta=BETA, loss_type="ipo", chosen_lengths=torch.tensor([float(n)]),
                                    rejected_lengths=torch.tensor([float(n)]))
        loss.backward()
        losses.append(loss.item())
        assert chosen.grad.item() * n == pytest.approx(2 * (1 - 5))  # gradient w.r.t. the per-token log-ratio
    assert losses == [pytest.approx(16.0), pytest.approx(16.0)]


def test_dpo_loss_split_invariant_with_global_pair_count():
    """sum over micro-batches of sum(losses)/N * dp, averaged over dp ranks == mean over all N pairs."""
    full, *_ = compute_dpo_loss(**tensors(), beta=BETA)
    parts = [compute_dpo_loss(*(v[i:i + 1] for v in tensors().values()), beta=BETA, dp_size=2,
                              global_batch_size=2)[0] for i in range(2)]
    assert (sum(parts) / 2).item() == pytest.approx(full.item())


def test_hinge_loss():
    loss, *_ = compute_dpo_loss(**tensors(), beta=BETA, loss_type="hinge")
    assert loss.item() == pytest.approx((0.8 + 1.1) / 2)  # relu(1 - 0.2), relu(1 + 0.1)


def test_dpo_validation():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"policy_rejected_logps=\(3,\)"):
        compute_dpo_loss(x, torch.zeros(3), x, x, beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        compute_dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="'kto'"):
        compute_dpo_loss(x, x, x, x, beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        compute_dpo_loss(x, x, x, x, beta=0.1, label_smoothing=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="chosen_lengths"):
        compute_dpo_loss(x, x, x, x, beta=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="length > 0"):
        compute_dpo_loss(x, x, x, x, beta=0.1, loss_type="ipo", chosen_lengths=torch.tensor([1.0, 0.0]),
                         rejected_lengths=torch.ones(2))
    with pytest.raises(ValueError, match=r"\(batch,\)"):
        compute_dpo_loss(torch.zeros(2, 2), x, x, x, beta=0.1)
