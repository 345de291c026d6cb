"""Registered policy losses, verl's calling convention:

    loss, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None)

Tensors are (bs, response_length); log-probs in nats; masked positions never
influence values or gradients.  ``config`` is the actor config (verl field
names: clip_ratio, clip_ratio_low/high, clip_ratio_c, tau_pos, tau_neg,
loss_scale_factor, global_batch_info, policy_loss.*), or None for verl's
defaults.  ``config.global_batch_info`` (see ``losses.global_batch_info``)
makes the aggregation invariant to micro-batching and data parallelism.
``rollout_is_weights`` (optional, same shape) multiplies the per-token loss.
``metrics`` maps verl's names (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``) to python floats.  Shape mismatches raise
ValueError.  Clip-Cov and KL-Cov live in cov_losses.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms._policy_inputs import agg_kwargs, apply_weights, as_metrics, clip_bounds, prepare
from rlhf.algorithms.config_access import config_get
from rlhf.algorithms.losses import LOG_RATIO_CLAMP, agg_loss, aggregate_sequences, ppo_clip_losses
from rlhf.algorithms.masked_ops import masked_mean
from rlhf.algorithms.registry import register_policy_loss

Tensor = torch.Tensor
_ZERO = torch.tensor(0.0)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """PPO clipped surrogate with dual clip and decoupled ranges (Schulman et al. 2017,
    arXiv:1707.06347, eq. 7; Ye et al. 2020, arXiv:1912.09729, eq. 5; DAPO eq. 10):

        r = exp(clamp(log pi - log pi_old, -20, 20))
        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));   l = min(l, -A c) where A < 0

    aggregated by ``loss_agg_mode``.  Same numbers as ``compute_policy_loss``.

    Raises:
        ValueError: shape mismatch or ``clip_ratio_c <= 1``.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(config)
    clip_ratio_c = config_get(config, "clip_ratio_c", 3.0)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")
    pg_losses, clipfrac, ppo_kl, clipfrac_lower = ppo_clip_losses(x.log_ratio, x.advantages, x.valid, low, high,
                                                                  clip_ratio_c)
    pg_losses = apply_weights(pg_losses, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    return loss, as_metrics(pg_clipfrac=clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=clipfrac_lower)


@register_policy_loss("gspo")
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
    return loss, as_metrics(pg_clipfrac=clipfrac, ppo_kl=masked_mean(-x.log_ratio, x.valid), pg_clipfrac_lower=_ZERO)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                             loss_agg_mode: str = "seq-mean-token-mean", config: Any = None,
                             rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """SAPO, Soft Adaptive Policy Optimization (Qwen team 2025, arXiv:2511.20347):
    a smooth sigmoid gate replaces the hard clip,

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
        l_t  = -f(r_t) * A_t

    so df/dr = 4 sigmoid (1 - sigmoid): 1 on-policy (r = 1, like the PG gradient),
    decaying smoothly as r leaves 1.  ``config.tau_pos`` / ``config.tau_neg``
    (defaults 1.0 / 1.05, verl's).  Aggregated ALWAYS as "seq-mean-token-mean" (as verl).

    Raises:
        ValueError: shape mismatch or a non-positive tau.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    tau_pos, tau_neg = config_get(config, "tau_pos", 1.0), config_get(config, "tau_neg", 1.05)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO needs tau_pos, tau_neg > 0, got {tau_pos}, {tau_neg}")
    ratio = torch.exp(torch.clamp(x.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    tau = torch.where(x.advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    pg_losses = apply_weights(-gates * x.advantages, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg_kwargs(config))
    return loss, as_metrics(pg_clipfrac=_ZERO, ppo_kl=masked_mean(-x.log_ratio, x.valid), pg_clipfrac_lower=_ZERO)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """GPG policy gradient (Chu et al. 2025, arXiv:2504.02546): the plain REINFORCE objective,
    no ratio, no clip,

        l_t = -A_t * log pi(y_t)

    aggregated by ``loss_agg_mode`` (the paper's 1/sum|o_i| sum_i sum_t is "token-mean").
    Pair it with ``algorithm.adv_estimator=gpg``.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pg_losses = apply_weights(-x.log_prob * x.advantages, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    return loss, as_metrics(ppo_kl=masked_mean(-x.log_ratio, x.valid))


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                              loss_agg_mode: str = "token-mean", config: Any = None,
                              rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, sec. 3):
    clip the importance weight, not the update, and stop its gradient, so every token
    keeps a gradient:

        r_hat = clip(r, 1 - eps_low, 1 + eps_high)
        l_t   = -sg(r_hat_t) * A_t * log pi(y_t)

    aggregated by ``loss_agg_mode`` (the paper's 1/sum|o_i| sum_i sum_t is "token-mean").
    ``actor.clip_ratio_low/high`` are eps_low / eps_high (MiniMax: no lower bound in
    effect, i.e. a large eps_low, and eps_high tuned).  ``pg_clipfrac`` = fraction of
    valid tokens whose weight was clipped.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(config)
    ratio = torch.exp(torch.clamp(x.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high).detach()
    pg_losses = apply_weights(-clipped_ratio * x.advantages * x.log_prob, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    clipfrac = masked_mean((ratio != clipped_ratio).to(ratio.dtype), x.valid)
    return loss, as_metrics(pg_clipfrac=clipfrac, ppo_kl=masked_mean(-x.log_ratio, x.valid), pg_clipfrac_lower=_ZERO)


@register_policy_loss("geo_mean")
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
