"""Policy losses plugged into :meth:`rlhf.workers.actor.MegatronActor.update_policy`.

A loss is a callable ``loss(outputs, micro_batch, prompt_length) -> (loss scalar, metrics)`` with three
attributes the update loop reads: ``keys`` (batch keys it needs besides the model inputs),
``needs_entropy`` (the forward computes per-token entropy) and ``micro_group`` (rows that must share a
micro batch).  ``outputs["log_probs"]`` is [b, S] with S >= P + R (rlhf.mcore.forward pads S at the
right under sequence parallelism); the response is columns [P, P + R) (:func:`response_part`),
P = `prompt_length`, R = ``micro_batch["response_mask"].shape[1]``.
"""
from __future__ import annotations

import torch

from rlhf import algorithms as algos

__all__ = ["PPOPolicyLoss", "DPOLoss", "dpo_loss_and_metrics", "response_part"]


def response_part(t: torch.Tensor, mb: dict, prompt_length: int) -> torch.Tensor:
    """The response columns [P, P + R) of a token output [b, S] (R from ``mb["response_mask"]``)."""
    return t[:, prompt_length:prompt_length + mb["response_mask"].shape[1]]


class PPOPolicyLoss:
    """Clipped policy loss (Schulman et al. 2017, eq. 7) with dual-clip (``clip_ratio_c``) and decoupled
    clip (``clip_ratio_low/high``), aggregated by ``loss_agg_mode``, minus ``entropy_coeff`` x entropy,
    plus ``kl_loss_coef`` x KL(actor || ref) (``kl_loss_type``) when ``use_kl_loss``.  `cfg` is the
    config's ``actor`` section.  Metrics: actor/pg_loss, actor/entropy, actor/pg_clipfrac,
    actor/ppo_kl, actor/pg_clipfrac_lower (+ actor/kl_loss)."""

    needs_entropy = True
    micro_group = 1

    def __init__(self, cfg):
        self.cfg = cfg
        self.keys = ("old_log_probs", "advantages", "response_mask") + (("ref_log_probs",) if cfg.use_kl_loss else ())

    def __call__(self, outs: dict, mb: dict, prompt_length: int):
        cfg, P, mask = self.cfg, prompt_length, mb["response_mask"]
        log_prob, entropy = response_part(outs["log_probs"], mb, P), response_part(outs["entropy"], mb, P)
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = algos.compute_policy_loss(
            old_log_prob=mb["old_log_probs"], log_prob=log_prob, advantages=mb["advantages"], response_mask=mask,
            cliprange=cfg.clip_ratio, cliprange_low=cfg.clip_ratio_low, cliprange_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode)
        entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        metrics = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy_loss.detach(),
                   "actor/pg_clipfrac": clipfrac.detach(), "actor/ppo_kl": ppo_kl.detach(),
                   "actor/pg_clipfrac_lower": clipfrac_lower.detach()}
        if cfg.use_kl_loss:
            kl = algos.kl_penalty(log_prob, mb["ref_log_probs"], cfg.kl_loss_type)
            kl_loss = algos.agg_loss(kl, mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics


def dpo_loss_and_metrics(logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor,
                         dcfg) -> tuple[torch.Tensor, dict]:
    """DPO loss (rlhf.algorithms.compute_dpo_loss, Rafailov et al. 2023 eq. 7 and variants) of sequence
    log-probs [2B] laid out [chosen_1, rejected_1, ...] against the reference's [2B]; `lengths` [2B] are
    the response lengths in tokens (IPO averages per token); `dcfg` is ``algorithm.dpo`` (beta,
    label_smoothing, loss_type).  Metrics: dpo/loss, dpo/accuracy (implicit reward of chosen >
    rejected), dpo/margin, dpo/chosen_rewards, dpo/rejected_rewards."""
    loss, chosen_r, rejected_r, _ = algos.compute_dpo_loss(
        logps[0::2], logps[1::2], ref_logps[0::2], ref_logps[1::2], dcfg.beta, dcfg.label_smoothing, dcfg.loss_type,
        chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])
    return loss, {"dpo/loss": loss.detach(), "dpo/accuracy": (chosen_r > rejected_r).float().mean(),
                  "dpo/margin": (chosen_r - rejected_r).mean(), "dpo/chosen_rewards": chosen_r.mean(),
                  "dpo/rejected_rewards": rejected_r.mean()}


class DPOLoss:
    """DPO on pair batches (rlhf.workers.batch.build_pair_batch): sequence log-probs are summed over the
    response tokens; ``ref_logps`` [2B] are the frozen reference's.  `dcfg` is ``algorithm.dpo``."""

    needs_entropy = False
    micro_group = 2  # a pair's chosen and rejected rows stay in one micro batch
    keys = ("response_mask", "ref_logps")

    def __init__(self, dcfg):
        self.dcfg = dcfg

    def __call__(self, outs: dict, mb: dict, prompt_length: int):
        logps = (response_part(outs["log_probs"], mb, prompt_length) * mb["response_mask"]).sum(1)
        return dpo_loss_and_metrics(logps, mb["ref_logps"], mb["response_mask"].sum(1), self.dcfg)
