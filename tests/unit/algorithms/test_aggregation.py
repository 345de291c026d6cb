"""Loss aggregation (rlhf/algorithms/aggregation.py): every mode by hand, and every mode (and every policy
loss built on it) gives the same loss AND gradient however a mini-batch is split into micro-batches (sizes 1,
2, 4) and data-parallel ranks (1, 2).

The simulation is what the trainer does: each rank takes its contiguous DP shard, sums the micro-batch
losses computed with the WHOLE mini-batch's counts (``global_batch_info``), and data-parallel gradient
averaging takes the mean over ranks.  The reference is the loss of the whole mini-batch in one call.
Hand check of the normalisation: with counts N_tok over dp ranks, micro-batch loss = local_sum / N_tok * dp,
so mean_r sum_mb (local_sum / N_tok * dp) = sum_all / N_tok.
"""

import itertools

import pytest
import torch

from rlhf.algorithms import ConfigOverlay, LOSS_AGG_MODES, agg_loss, get_policy_loss_fn, global_batch_info
from tests.unit.algorithms.helpers import INF, NAN, t

B, L = 8, 5
# unequal lengths, one fully masked row (an excluded sample) and a masked span inside a response
LENGTHS = [5, 1, 3, 0, 2, 4, 5, 3]


def mask():
    m = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in LENGTHS], dtype=torch.float64)
    m[6, 2] = 0.0
    return m


def split_total(loss_of, dp, micro):
    """mean over dp ranks of the sum over that rank's micro-batches of loss_of(rows, dp)."""
    per_rank = B // dp
    totals = []
    for rank in range(dp):
        rows = range(rank * per_rank, (rank + 1) * per_rank)
        chunks = [list(rows)[i:i + micro] for i in range(0, per_rank, micro)]
        totals.append(sum(loss_of(torch.tensor(c), dp) for c in chunks))
    return sum(totals) / dp


SPLITS = list(itertools.product([1, 2], [1, 2, 4]))


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


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dp,micro", SPLITS)
def test_agg_loss_invariant_to_micro_batch_and_dp(mode, dp, micro):
    torch.manual_seed(0)
    m = mask()
    theta = torch.randn(B, L, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(B, L, dtype=torch.float64)
    loss_mat = lambda rows: theta[rows] ** 2 * weights[rows]  # noqa: E731

    reference = agg_loss(loss_mat(torch.arange(B)), m, mode)
    (ref_grad,) = torch.autograd.grad(reference, theta)
    info = global_batch_info(m, dp)
    total = split_total(lambda rows, dp_: agg_loss(loss_mat(rows), m[rows], mode, **info), dp, micro)
    (grad,) = torch.autograd.grad(total, theta)
    torch.testing.assert_close(total, reference)
    torch.testing.assert_close(grad, ref_grad)


def test_the_check_can_fail_without_global_counts():
    """Local counts (verl's default path): token-mean over micro-batches of 1 row averages the per-row
    means: rows [1] (1 token) and [3, 3, 3] (3 tokens) give (1 + 3) / 2 = 2, not (1 + 9) / 4 = 2.5."""
    loss = torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    m = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    local = sum(agg_loss(loss[i:i + 1], m[i:i + 1], "token-mean") for i in range(2)) / 2
    assert local.item() == pytest.approx(2.0) and agg_loss(loss, m, "token-mean").item() == pytest.approx(10 / 4)


def test_dr_grpo_norm_does_not_grow_with_the_number_of_rows():
    """seq-mean-token-sum-norm: two identical rows give the loss of one row (token sum / C, mean over rows).
    Row [1, 2, 0 (masked)], C = 3: (1 + 2) / 3 = 1."""
    row, m = torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    one = agg_loss(row, m, "seq-mean-token-sum-norm")
    two = agg_loss(row.repeat(2, 1), m.repeat(2, 1), "seq-mean-token-sum-norm")
    assert one.item() == pytest.approx(1.0) and two.item() == pytest.approx(1.0)


def test_token_sum_hand_values():
    """token-sum (verl's mode): the masked sum, times dp_size.  Rows [1, 2, (30 masked)] and [4, (50 masked), 6]:
    1 + 2 + 4 + 6 = 13; with dp_size 4 (each rank's sum is scaled so that averaging over 4 ranks sums): 52.
    The global counts do not enter; a masked NaN does not leak."""
    loss = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 50.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert agg_loss(loss, m, "token-sum").item() == 13.0
    assert agg_loss(loss, m, "token-sum", dp_size=4, batch_num_tokens=99, global_batch_size=7).item() == 52.0
    assert agg_loss(loss, torch.zeros_like(m), "token-sum").item() == 0.0


def test_global_batch_info_counts():
    """Tokens: 5 + 1 + 3 + 0 + 2 + 4 + 4 (row 6 has a masked span) + 3 = 22; rows with a token: 7."""
    assert global_batch_info(mask(), dp_size=2) == {"dp_size": 2, "batch_num_tokens": 22, "global_batch_size": 7}
    with pytest.raises(ValueError, match="dp_size"):
        global_batch_info(mask(), dp_size=0)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "sapo", "gpg", "cispo", "geo_mean"])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("dp,micro", SPLITS)
def test_policy_losses_invariant_to_micro_batch_and_dp(loss_mode, agg, dp, micro):
    """The registered policy losses read config.global_batch_info; the same invariance holds.
    (Clip-Cov / KL-Cov select tokens per call, see cov_losses.py, and are not split-invariant.)"""
    torch.manual_seed(1)
    m = mask()
    old = torch.randn(B, L, dtype=torch.float64) * 0.1
    log_prob = (old + torch.randn(B, L, dtype=torch.float64) * 0.1).requires_grad_()
    adv = torch.randn(B, 1, dtype=torch.float64).expand(B, L).contiguous()
    fn = get_policy_loss_fn(loss_mode)
    base = {"clip_ratio": 0.2, "loss_scale_factor": 7}

    reference, _ = fn(old, log_prob, adv, m, agg, base)
    (ref_grad,) = torch.autograd.grad(reference, log_prob)
    config = ConfigOverlay(base, global_batch_info=global_batch_info(m, dp))
    total = split_total(lambda rows, dp_: fn(old[rows], log_prob[rows], adv[rows], m[rows], agg, config)[0], dp, micro)
    (grad,) = torch.autograd.grad(total, log_prob)
    torch.testing.assert_close(total, reference)
    torch.testing.assert_close(grad, ref_grad)


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
