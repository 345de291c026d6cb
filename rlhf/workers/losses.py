"""Policy losses plugged into :meth:`rlhf.workers.actor.MegatronActor.update_policy`.

A loss is a callable ``loss(outputs, micro_batch, prompt_length) -> (loss scalar, metrics)`` with four
attributes the update loop reads: ``keys`` (batch keys it needs besides the model inputs),
``needs_entropy`` (the forward computes per-token entropy), ``micro_group`` (rows that must share a
micro batch) and ``global_info(full_mini_batch, dp_size) -> dict`` (counts of the whole mini batch).
``outputs["log_probs"]`` is [b, S] with S >= P + R (parallel.forward pads S at the right under
sequence parallelism); the response is columns [P, P + R) (:func:`response_part`), P = `prompt_length`,
R = ``micro_batch["response_mask"].shape[1]``.

Micro-batch and data-parallel invariance ("the x n_micro rule").  Each micro batch's loss is its
share of the WHOLE mini batch's loss: sums over its tokens / sequences divided by the mini batch's
counts (``micro_batch[GLOBAL_INFO_KEY]``, rlhf.algorithms.agg_loss) times ``dp_size`` (megatron's DDP
averages gradients over data-parallel ranks) times ``num_micro_batches`` (megatron's schedule divides
each micro batch loss by it).  The gradient of an optimizer step is then the gradient of the mini
batch's loss in one piece, however it was cut; the loss metrics (averaged over micro batches and
ranks by rlhf.workers.worker.gather_metrics) are the mini batch's loss.

Token-mean metrics (a loss's ``token_means``: ``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``) are each micro batch's mean over its loss tokens, as the policy loss functions
return them (verl's convention); the micro batch also reports its number of loss tokens (``LOSS_TOKENS_KEY``)
and gather_metrics weights by it: sum of masked sums / valid tokens over every micro batch and rank, the same
for any cut.
"""
from __future__ import annotations

import torch

from rlhf import algorithms as algos
from rlhf.algorithms.rollout_corr import compute_rollout_corr_metrics_from_logprobs

from .worker import GLOBAL_INFO_KEY, LOSS_TOKENS_KEY

__all__ = ["PPOPolicyLoss", "DPOLoss", "dpo_loss_and_metrics", "response_part", "LOSS_MASK_KEY", "POLICY_TOKEN_MEANS"]

#: the PPO batch's loss mask [N, R]: the response mask without the samples left out of the loss
LOSS_MASK_KEY = "loss_mask"
#: the policy loss metrics that are means over the loss tokens (verl's names; token-weighted by gather_metrics)
POLICY_TOKEN_MEANS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def response_part(t: torch.Tensor, mb: dict, prompt_length: int) -> torch.Tensor:
    """The response columns [P, P + R) of a token output [b, S] (R from ``mb["response_mask"]``)."""
    return t[:, prompt_length:prompt_length + mb["response_mask"].shape[1]]


def split_scale(mb: dict) -> tuple[dict, float]:
    """(agg_loss keyword arguments, num_micro_batches) from the micro batch's GLOBAL_INFO_KEY entry; without
    one (a call outside the update loop) the micro batch is the whole mini batch: ({}, 1)."""
    info = dict(mb.get(GLOBAL_INFO_KEY) or {})
    n_micro = info.pop("num_micro_batches", 1)
    return info, n_micro


class PPOPolicyLoss:
    """The policy loss ``actor.policy_loss.loss_mode`` from rlhf.algorithms' registry (verl's calling
    convention: vanilla PPO clip with dual clip and decoupled ranges, gspo, sapo, gpg, cispo, geo_mean,
    clip_cov, kl_cov; docs/algorithms.md) on the ``loss_mask`` tokens, aggregated by ``loss_agg_mode``
    with the mini batch's counts, minus ``entropy_coeff`` x entropy, plus ``kl_loss_coef`` x
    KL(actor || ref) (``kl_loss_type``) when ``use_kl_loss``.  `cfg` is the config's ``actor`` section.
    Metrics: actor/pg_loss, actor/entropy and the loss function's (actor/pg_clipfrac, actor/ppo_kl,
    actor/pg_clipfrac_lower, ...) (+ actor/kl_loss); the micro batch's loss tokens under LOSS_TOKENS_KEY weight
    the ``token_means`` (module docstring).

    Raises ValueError at construction for an unknown loss mode (the registry's message lists them)."""

    needs_entropy = True
    micro_group = 1
    token_means = POLICY_TOKEN_MEANS

    def __init__(self, cfg, rollout_correction=None):
        """`rollout_correction`: the config's ``algorithm.rollout_correction`` (rlhf.algorithms.rollout_corr), for
        a PPO batch with the engine's ``rollout_log_probs``: each micro batch then also reports the current policy's
        ``rollout_corr/...`` off-policy metrics against them (verl's actor does), the loss multiplies by the
        batch's ``rollout_is_weights`` when ``rollout_is`` is set, and ``bypass_mode`` selects verl's bypass_mode
        loss (the correction computed inside it) whatever ``policy_loss.loss_mode`` says."""
        self.cfg = cfg
        policy_loss = getattr(cfg, "policy_loss", None)
        self.loss_mode = getattr(policy_loss, "loss_mode", None) or "vanilla"
        rc = self.rollout_correction = rollout_correction
        self.bypass = bool(rc is not None and rc.bypass_mode) or self.loss_mode == "bypass_mode"
        if self.bypass:  # (loss_mode=bypass_mode alone: verl's defaults, PPO clip against the batch's old_log_probs)
            self.loss_mode = "bypass_mode"
            if rc is None:
                self.rollout_correction = {"loss_type": "ppo_clip"}
        self.policy_loss_fn = algos.get_policy_loss_fn(self.loss_mode)
        self.use_is_weights = rc is not None and not self.bypass and rc.rollout_is is not None
        self.keys = ("old_log_probs", "advantages", "response_mask", LOSS_MASK_KEY) + (
            ("ref_log_probs",) if cfg.use_kl_loss else ()) + (
            ("rollout_log_probs",) if rc is not None and not self.bypass else ()) + (
            ("rollout_is_weights",) if self.use_is_weights else ())

    @staticmethod
    def global_info(full: dict, dp_size: int) -> dict:
        """Token and sequence counts of the whole mini batch's loss mask (rlhf.algorithms.global_batch_info)."""
        return algos.global_batch_info(full[LOSS_MASK_KEY], dp_size)

    def __call__(self, outs: dict, mb: dict, prompt_length: int):
        cfg, P, mask = self.cfg, prompt_length, mb[LOSS_MASK_KEY]
        info, n_micro = split_scale(mb)
        log_prob, entropy = response_part(outs["log_probs"], mb, P), response_part(outs["entropy"], mb, P)
        extra = {"policy_loss": {"loss_mode": self.loss_mode, "rollout_correction": self.rollout_correction}} \
            if self.bypass else {}
        config = algos.ConfigOverlay(cfg, global_batch_info=info, **extra)
        pg_loss, pg_metrics = self.policy_loss_fn(mb["old_log_probs"], log_prob, mb["advantages"], mask,
                                                  cfg.loss_agg_mode, config,
                                                  rollout_is_weights=mb["rollout_is_weights"] if self.use_is_weights
                                                  else None)
        if "rollout_log_probs" in self.keys and bool(mask.any()):  # verl's actor: pi_theta against the engine's
            with torch.no_grad():
                pg_metrics.update(compute_rollout_corr_metrics_from_logprobs(log_prob.detach(),
                                                                             mb["rollout_log_probs"], mask))
        agg = dict(info, loss_scale_factor=getattr(cfg, "loss_scale_factor", None))
        entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        metrics = {"actor/pg_loss": pg_loss.detach() * n_micro, "actor/entropy": entropy_loss.detach() * n_micro,
                   **pg_metrics, LOSS_TOKENS_KEY: (mask != 0).sum()}
        if cfg.use_kl_loss:
            kl = algos.kl_penalty(log_prob, mb["ref_log_probs"], cfg.kl_loss_type)
            kl_loss = algos.agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach() * n_micro
        return loss * n_micro, metrics


def dpo_loss_and_metrics(logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor,
                         dcfg, dp_size: int = 1, global_batch_size: int | None = None) -> tuple[torch.Tensor, dict]:
    """DPO loss (rlhf.algorithms.compute_dpo_loss, Rafailov et al. 2023 eq. 7 and variants) of sequence
    log-probs [2B] laid out [chosen_1, rejected_1, ...] against the reference's [2B]; `lengths` [2B] are
    the response lengths in tokens (IPO averages per token); `dcfg` is ``algorithm.dpo`` (beta,
    label_smoothing, loss_type); `dp_size` / `global_batch_size` (pairs of the whole mini batch): the
    loss is sum / global_batch_size x dp_size (default: the mean over these B pairs).  Metrics:
    dpo/loss (this call's loss), dpo/accuracy (implicit reward of chosen > rejected), dpo/margin,
    dpo/chosen_rewards, dpo/rejected_rewards."""
    loss, chosen_r, rejected_r, _ = algos.compute_dpo_loss(
        logps[0::2], logps[1::2], ref_logps[0::2], ref_logps[1::2], dcfg.beta, dcfg.label_smoothing, dcfg.loss_type,
        chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2], dp_size=dp_size,
        global_batch_size=global_batch_size)
    return loss, {"dpo/loss": loss.detach(), "dpo/accuracy": (chosen_r > rejected_r).float().mean(),
                  "dpo/margin": (chosen_r - rejected_r).mean(), "dpo/chosen_rewards": chosen_r.mean(),
                  "dpo/rejected_rewards": rejected_r.mean()}


class DPOLoss:
    """DPO on pair batches (rlhf.workers.batch.build_pair_batch): sequence log-probs are summed over the
    response tokens; ``ref_logps`` [2B] are the frozen reference's.  `dcfg` is ``algorithm.dpo``.  The
    loss is the mean over the mini batch's pairs however they are cut into micro batches and ranks
    (module docstring); the dpo/* metrics are means over pairs."""

    needs_entropy = False
    micro_group = 2  # a pair's chosen and rejected rows stay in one micro batch
    keys = ("response_mask", "ref_logps")

    def __init__(self, dcfg):
        self.dcfg = dcfg

    @staticmethod
    def global_info(full: dict, dp_size: int) -> dict:
        """Pairs of the whole mini batch."""
        return {"global_batch_size": full["response_mask"].shape[0] // 2}

    def __call__(self, outs: dict, mb: dict, prompt_length: int):
        logps = (response_part(outs["log_probs"], mb, prompt_length) * mb["response_mask"]).sum(1)
        info, n_micro = split_scale(mb)
        loss, metrics = dpo_loss_and_metrics(logps, mb["ref_logps"], mb["response_mask"].sum(1), self.dcfg,
                                             dp_size=info.get("dp_size", 1),
                                             global_batch_size=info.get("global_batch_size"))
        metrics["dpo/loss"] = loss.detach() * n_micro
        return loss * n_micro, metrics
