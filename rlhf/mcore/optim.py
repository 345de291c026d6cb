"""Megatron DDP + optimizer + LR scheduler for a list of model chunks.

Thin wiring of megatron-core's own pieces (DistributedDataParallel, get_megatron_optimizer with
the optional distributed optimizer, OptimizerParamScheduler), so actor and critic train the same
way Megatron-LM does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.mcore import cpu_patches  # noqa: F401
from rlhf.mcore.optim_config import LRDecayStyle, OptimConfig


@dataclass
class TrainState:
    """What one trainable role holds: DDP-wrapped chunks, optimizer, scheduler."""

    model: list  # DDP-wrapped chunks
    optimizer: object
    scheduler: object


def wrap_ddp(chunks, config, use_distributed_optimizer: bool = True) -> list:
    """Wrap each GPTModel chunk in megatron DDP (fp32 grad buffers); sets the config hooks the
    pipeline schedule uses (finalize_model_grads, no_sync)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                       disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def build_train_state(chunks, config, optim: OptimConfig) -> TrainState:
    """DDP-wrap `chunks` and build the megatron optimizer and LR scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if optim.lr_decay_style not in tuple(LRDecayStyle):
        raise ValueError(f"lr_decay_style={optim.lr_decay_style!r}: use one of {[s.value for s in LRDecayStyle]}")
    model = wrap_ddp(chunks, config, optim.use_distributed_optimizer)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, use_distributed_optimizer=optim.use_distributed_optimizer,
        bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype)
    optimizer = get_megatron_optimizer(opt_config, model)
    decay_steps = optim.lr_decay_steps or 1_000_000_000
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps, lr_decay_steps=max(decay_steps, optim.lr_warmup_steps + 1),
        lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")
    return TrainState(model, optimizer, scheduler)


def zero_grads(state: TrainState) -> None:
    for m in state.model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()


def optimizer_step(state: TrainState) -> tuple[bool, float]:
    """One optimizer + scheduler step. Returns (update_successful, grad_norm)."""
    ok, grad_norm, _ = state.optimizer.step()
    if ok:
        state.scheduler.step(increment=1)
    return bool(ok), float(grad_norm) if grad_norm is not None else 0.0
