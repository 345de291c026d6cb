"""Sequence-level importance ratios: GSPO (one clipped ratio per response) and GMPO (the
geometric mean of the token-clipped ratios).  Calling convention, config fields and metrics: policy_losses/__init__.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.aggregation import agg_loss, aggregate_sequences
from rlhf.algorithms.masked_ops import masked_mean
from rlhf.algorithms.policy_losses._inputs import ZERO, agg_kwargs, apply_weights, as_metrics, clip_bounds, prepare
from rlhf.algorithms.registry import PolicyLossMode, register_policy_loss

Tensor = torch.Tensor


@register_policy_loss(PolicyLossMode.GSPO)
def compute_policy_loss_gspo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                             loss_agg_mode: str = "seq-mean-token-mean", config: Any = None,
                             rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071;
    the GSPO-token form of the objective).  The importance ratio is per SEQUENCE,
    the geometric mean of the token ratios over the |y_i| valid tokens:

        s_i     = exp( (1/|y_i|) sum_t (log pi(y_i,t) - log pi_old(y_i,t)) )
        s_i,t   = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]     (value s_i, gradient s_i * grad log pi)
        l_i,t   = max(-A_i,t s_i,t, -A_i,t clip(s_i,t, 1 - eps_low, 1 + eps_high))

    aggregated ALWAYS as "seq-mean-token-mean" (the paper's 1/G sum_i 1/|y_i| sum_t;
    ``loss_agg_mode`` is ignored, as in verl).  log s is clamped at 10.  The paper's
    ranges are tiny (eps_low = 3e-4, eps_high = 4e-4).
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(config)
    lengths = x.valid.sum(dim=-1).clamp_min(1).to(log_prob.dtype)
    seq_log_ratio = x.log_ratio.sum(dim=-1) / lengths
    log_s = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    unclipped, clipped = -x.advantages * s, -x.advantages * torch.clamp(s, 1 - low, 1 + high)
    pg_losses = apply_weights(torch.maximum(unclipped, clipped), rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg_kwargs(config))
    clipfrac = masked_mean((clipped > unclipped).to(s.dtype), x.valid)
    return loss, as_metrics(pg_clipfrac=clipfrac, ppo_kl=masked_mean(-x.log_ratio, x.valid), pg_clipfrac_lower=ZERO)


@register_policy_loss(PolicyLossMode.GEO_MEAN)
def compute_policy_loss_geo_mean(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                 loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673):
    the sequence objective uses the geometric mean of the token-clipped ratios,

        d_t   = log pi(y_t) - log pi_old(y_t)
        d'_t  = sgn(A) * min(sgn(A) d_t, sgn(A) clip(d_t, -eps_low, eps_high))
        l_i   = -A_i * exp( (1/|y_i|) sum_t d'_t ),   A_i = token-mean of A over sequence i

    and the loss is the mean of l_i over the sequences with a valid token
    (``loss_agg_mode`` is ignored; ``global_batch_info`` still applies).  The clip is in
    LOG space: ``clip_ratio_low/high`` bound the log-ratio (the paper uses 0.4 each).
    Token rollout weights enter as their geometric mean over the sequence.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(config)
    sign = torch.sign(x.advantages)
    clamped = torch.clamp(x.log_ratio, -low, high)
    pessimistic = sign * torch.minimum(sign * x.log_ratio, sign * clamped)
    lengths = x.valid.sum(dim=-1).to(log_prob.dtype)
    has_tokens = lengths > 0
    seq_ratio = torch.exp(pessimistic.sum(dim=-1) / lengths.clamp_min(1))
    seq_advantage = x.advantages.sum(dim=-1) / lengths.clamp_min(1)
    seq_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.where(x.valid, torch.log(rollout_is_weights.detach() + 1e-10), torch.zeros_like(x.log_ratio))
        seq_losses = seq_losses * torch.exp(log_w.sum(dim=-1) / lengths.clamp_min(1))
    kwargs = agg_kwargs(config)
    loss = aggregate_sequences(seq_losses, has_tokens, kwargs["dp_size"], kwargs["global_batch_size"])
    was_clipped = (x.log_ratio != clamped).to(log_prob.dtype)
    return loss, as_metrics(pg_clipfrac=masked_mean(was_clipped * (x.advantages > 0), x.valid),
                            ppo_kl=masked_mean(-x.log_ratio, x.valid),
                            pg_clipfrac_lower=masked_mean(was_clipped * (x.advantages < 0), x.valid))
