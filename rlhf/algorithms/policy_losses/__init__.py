"""Registered policy losses, verl's calling convention:

    loss, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None)

Tensors are (bs, response_length); log-probs in nats; masked positions never
influence values or gradients.  ``config`` is the actor config (verl field
names: clip_ratio, clip_ratio_low/high, clip_ratio_c, tau_pos, tau_neg,
loss_scale_factor, global_batch_info, policy_loss.*), or None for verl's
defaults.  ``config.global_batch_info`` (see ``aggregation.global_batch_info``)
makes the aggregation invariant to micro-batching and data parallelism.
``rollout_is_weights`` (optional, same shape) multiplies the per-token loss.
``metrics`` maps verl's names (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``) to python floats.  Shape mismatches raise
ValueError.

Families: ppo (vanilla dual-clip PPO with DAPO's decoupled clip-higher ranges, SAPO),
sequence_level (GSPO, GMPO ``geo_mean``), policy_gradient (GPG, CISPO), covariance
(Clip-Cov, KL-Cov), bypass (rollout correction's bypass mode: PPO clip or REINFORCE against the
engine's log-probs).  DAPO's token-level pieces are the decoupled ranges of ``vanilla`` and
``loss_agg_mode="token-mean"`` (rlhf.algorithms.aggregation).
"""

from rlhf.algorithms.policy_losses.bypass import compute_policy_loss_bypass_mode, compute_policy_loss_reinforce
from rlhf.algorithms.policy_losses.covariance import compute_policy_loss_clip_cov, compute_policy_loss_kl_cov
from rlhf.algorithms.policy_losses.policy_gradient import compute_policy_loss_cispo, compute_policy_loss_gpg
from rlhf.algorithms.policy_losses.ppo import compute_policy_loss, compute_policy_loss_sapo, compute_policy_loss_vanilla
from rlhf.algorithms.policy_losses.sequence_level import compute_policy_loss_geo_mean, compute_policy_loss_gspo

__all__ = ["compute_policy_loss", "compute_policy_loss_bypass_mode", "compute_policy_loss_reinforce",
           "compute_policy_loss_cispo", "compute_policy_loss_clip_cov",
           "compute_policy_loss_geo_mean", "compute_policy_loss_gpg", "compute_policy_loss_gspo",
           "compute_policy_loss_kl_cov", "compute_policy_loss_sapo", "compute_policy_loss_vanilla"]
