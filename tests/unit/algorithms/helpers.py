"""Input builders shared by the algorithm tests (not a test module).

Padding holds NaN / inf wherever a function must ignore it, so a leak shows up as a non-finite result.
"""

import math
import statistics

import torch

from rlhf.algorithms import get_policy_loss_fn

NAN, INF = float("nan"), float("inf")
EPS = 1e-6


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def whiten(xs):
    """Plain-python whitening with the unbiased std (what masked_whiten should do)."""
    mean, std = statistics.mean(xs), statistics.stdev(xs)
    return [(x - mean) / math.sqrt(std**2 + 1e-8) for x in xs]


def scatter(valid_values, mask_row):
    """Place values at the mask's valid positions of a row, 0 elsewhere."""
    it = iter(valid_values)
    return [next(it) if m else 0.0 for m in mask_row]


def outcome_rewards(scores, lengths, width, pad=NAN):
    """Outcome reward on the last valid token; NaN in padding to prove it never leaks."""
    rewards, mask = [], []
    for score, n in zip(scores, lengths):
        rewards.append([0.0] * (n - 1) + [score] + [pad] * (width - n))
        mask.append([1] * n + [0] * (width - n))
    return t(rewards), t(mask)


def outcome(scores, lengths, width=4, dtype=torch.float64):
    """Outcome reward on the last valid token, NaN padding (must never leak)."""
    rewards = [[0.0] * (n - 1) + [s] + [NAN] * (width - n) for s, n in zip(scores, lengths)]
    mask = [[1] * n + [0] * (width - n) for n in lengths]
    return t(rewards, dtype), t(mask, dtype)


def per_sample(adv):
    """The advantage of each row (every valid token carries the same scalar)."""
    return adv[:, 0].tolist()


# ----------------------------------------------------------------- policy losses
# old_log_prob = 0, so log r = log_prob; two responses of UNEQUAL length:
#     row 0: log_prob [0.1, 0.3, pad], A = +1 on both tokens
#     row 1: log_prob [0.0, -0.3, 0.0], A = -0.5 on all three tokens


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def inputs():
    log_prob = torch.tensor([[0.1, 0.3, NAN], [0.0, -0.3, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, NAN], [0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, NAN], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    return old, log_prob, adv, mask


def run(mode, config=None, agg="token-mean"):
    """(loss, d loss / d log_prob, metrics) of the registered loss ``mode`` on :func:`inputs`."""
    old, log_prob, adv, mask = inputs()
    loss, metrics = get_policy_loss_fn(mode)(old, log_prob, adv, mask, agg, config)
    loss.backward()
    return loss.item(), log_prob.grad, metrics


def grad(rows):
    return torch.tensor(rows, dtype=torch.float64)
