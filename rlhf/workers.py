"""Actor, reference and critic computations on the megatron side: log-probs, values, PPO updates.

Every function is collective over the whole trainer job: each data-parallel rank works on its
slice of the batch, and results are all-gathered so every rank holds full-batch tensors.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

from rlhf.mcore.forward import forward_backward
from rlhf.mcore.optim import optimizer_step, zero_grads
from rlhf import algorithms as algos
from rlhf.batch import dp_all_gather, dp_slice

_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")


def _dp():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


def _micro(n_local: int, requested: int) -> int:
    mbs = max(1, min(requested, n_local))
    while n_local % mbs:
        mbs -= 1
    return mbs


def compute_log_probs(chunks, batch: dict, *, vocab_size: int, temperature: float, micro_batch_size: int,
                      calculate_entropy: bool = False) -> dict:
    """Per-token log-probs (and entropy) of the response tokens, [N, R] on every rank."""
    rank, size, group = _dp()
    local = {k: dp_slice(batch[k], rank, size) for k in _MODEL_KEYS}
    with torch.no_grad():
        out = forward_backward(chunks, local, kind="log_probs", vocab_size=vocab_size, temperature=temperature,
                               micro_batch_size=_micro(local["input_ids"].shape[0], micro_batch_size),
                               calculate_entropy=calculate_entropy)
    R = batch["responses"].shape[1]
    return {k: dp_all_gather(v[:, -R:].contiguous(), group, size) for k, v in out.items()}


def compute_values(chunks, batch: dict, *, micro_batch_size: int) -> torch.Tensor:
    """Critic values V(s_t) for each response position t: the value head at the token before it. [N, R]."""
    rank, size, group = _dp()
    local = {k: dp_slice(batch[k], rank, size) for k in _MODEL_KEYS}
    with torch.no_grad():
        out = forward_backward(chunks, local, kind="values",
                               micro_batch_size=_micro(local["input_ids"].shape[0], micro_batch_size))
    P, R = batch["prompt_length"], batch["responses"].shape[1]
    values = out["values"][:, P - 1:P - 1 + R] * dp_slice(batch["response_mask"], rank, size)
    return dp_all_gather(values.contiguous(), group, size)


def gather_metrics(per_micro: list[dict]) -> dict:
    """Mean of each metric over micro batches and over every rank that has it (the last PP stage)."""
    local = defaultdict(list)
    for m in per_micro:
        for k, v in m.items():
            local[k].append(float(v))
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, dict(local))
    merged = defaultdict(list)
    for o in objs:
        for k, v in (o or {}).items():
            merged[k].extend(v)
    return {k: float(np.mean(v)) for k, v in merged.items()}


def _mini_batches(batch: dict, keys, n_mini: int, epoch_seed: int | None):
    rank, size, _ = _dp()
    N = batch["input_ids"].shape[0]
    order = torch.arange(N)
    if epoch_seed is not None:
        order = torch.randperm(N, generator=torch.Generator().manual_seed(epoch_seed))
    for idx in order.chunk(n_mini):
        yield {k: dp_slice(batch[k][idx], rank, size) for k in keys}


def update_actor(state, batch: dict, cfg, *, vocab_size: int, temperature: float, step: int) -> dict:
    """PPO actor update: `cfg.ppo_epochs` passes over mini batches of `cfg.ppo_mini_batch_size`
    prompts (x n); clipped policy loss (Schulman et al. 2017, eq. 7) with dual-clip and decoupled
    clip, minus `entropy_coeff` x entropy, plus `kl_loss_coef` x KL(actor || ref) when use_kl_loss.
    Returns averaged metrics (actor/pg_loss, actor/entropy, actor/grad_norm, ...)."""
    R = batch["responses"].shape[1]
    n_seq = batch["input_ids"].shape[0]
    n_mini = max(1, n_seq // (cfg.ppo_mini_batch_size * batch["n"]))
    keys = list(_MODEL_KEYS) + ["old_log_probs", "advantages", "response_mask"] + (
        ["ref_log_probs"] if cfg.use_kl_loss else [])

    def loss_fn(outs, mb):
        log_prob, entropy, mask = outs["log_probs"][:, -R:], outs["entropy"][:, -R:], mb["response_mask"]
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

    per_micro, grad_norms = [], []
    for epoch in range(cfg.ppo_epochs):
        for mb in _mini_batches(batch, keys, n_mini, None if cfg.ppo_epochs == 1 else step * 1000 + epoch):
            zero_grads(state)
            per_micro += forward_backward(state.model, mb, kind="log_probs", vocab_size=vocab_size,
                                          temperature=temperature, calculate_entropy=True, forward_only=False,
                                          micro_batch_size=_micro(mb["input_ids"].shape[0],
                                                                  cfg.ppo_micro_batch_size_per_gpu),
                                          loss_fn=loss_fn)
            ok, grad_norm = optimizer_step(state)
            grad_norms.append(grad_norm)
    metrics = gather_metrics(per_micro)
    metrics["actor/grad_norm"] = float(np.mean(grad_norms))
    metrics["actor/lr"] = float(state.optimizer.param_groups[0]["lr"])
    return metrics


def update_critic(state, batch: dict, cfg, *, step: int) -> dict:
    """Critic update with the clipped value loss (verl / PPO2 convention), same batching as the actor."""
    P, R = batch["prompt_length"], batch["responses"].shape[1]
    n_seq = batch["input_ids"].shape[0]
    n_mini = max(1, n_seq // (cfg.ppo_mini_batch_size * batch["n"]))
    keys = list(_MODEL_KEYS) + ["values", "returns", "response_mask"]

    def loss_fn(outs, mb):
        vpreds = outs["values"][:, P - 1:P - 1 + R]
        vf_loss, vf_clipfrac = algos.compute_value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                                        cfg.cliprange_value, cfg.loss_agg_mode)
        return vf_loss, {"critic/vf_loss": vf_loss.detach(), "critic/vf_clipfrac": vf_clipfrac.detach(),
                         "critic/vpred_mean": algos.masked_mean(vpreds, mb["response_mask"]).detach()}

    per_micro, grad_norms = [], []
    for epoch in range(cfg.ppo_epochs):
        for mb in _mini_batches(batch, keys, n_mini, None if cfg.ppo_epochs == 1 else step * 1000 + epoch + 7):
            zero_grads(state)
            per_micro += forward_backward(state.model, mb, kind="values", forward_only=False, loss_fn=loss_fn,
                                          micro_batch_size=_micro(mb["input_ids"].shape[0],
                                                                  cfg.ppo_micro_batch_size_per_gpu))
            ok, grad_norm = optimizer_step(state)
            grad_norms.append(grad_norm)
    metrics = gather_metrics(per_micro)
    metrics["critic/grad_norm"] = float(np.mean(grad_norms))
    return metrics
