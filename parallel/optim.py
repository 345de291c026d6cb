"""Megatron DDP + optimizer + LR scheduler for a list of model chunks, and the guarded optimizer step.

Thin wiring of megatron-core's own pieces (DistributedDataParallel, get_megatron_optimizer with
the optional distributed optimizer, OptimizerParamScheduler), so actor and critic train the same
way Megatron-LM does.  Two deliberate differences from Megatron-LM's train_step:

- the LR of optimizer step k is the schedule at k (`parallel.lr_schedule`): warm-up step 1 is
  not wasted at LR 0;
- a step whose global grad norm is inf/NaN is skipped.  megatron-core 0.16.1 checks for inf/NaN
  only through the fp16 grad scaler; in fp32/bf16 it clips with coefficient clip/inf = 0
  (0 * inf = NaN) and Adam writes NaN into the weights and moments for good.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel import cpu_patches  # noqa: F401
from parallel import distributed
from parallel.optim_config import MEGATRON_DTYPES, LRDecayStyle, OptimConfig, megatron_dtype_name
from parallel.step_guard import BreakerEvent, StepGuard, StepGuardConfig


@dataclass
class TrainState:
    """What one trainable role holds: DDP-wrapped chunks, optimizer, scheduler, step guard."""

    model: list  # DDP-wrapped chunks
    optimizer: object
    scheduler: object  # StepAlignedScheduler; its state_dict() carries the guard's counters
    guard: StepGuard | None = None


@dataclass
class StepResult:
    """Outcome of one `optimizer_step`.

    skipped: the grad norm was inf/NaN (or the fp16 grad scaler found an overflow): weights,
        optimizer state and LR schedule are unchanged.
    grad_norm: global L2 norm of the gradients before clipping (inf/NaN when skipped).
    lr: learning rate this step used (would have used, when skipped).
    breaker: set when the gradient circuit breaker fired on this step (warm-up restarted).

    Unpacks and indexes as the former `(update_successful, grad_norm)` pair, so existing callers
    (`ok, grad_norm = optimizer_step(s)`, `optimizer_step(s)[1]`) keep working.
    """

    skipped: bool
    grad_norm: float
    lr: float
    breaker: BreakerEvent | None = None

    def __iter__(self):
        return iter((not self.skipped, self.grad_norm))

    def __getitem__(self, i):
        return (not self.skipped, self.grad_norm)[i]


def wrap_ddp(chunks, config, use_distributed_optimizer: bool = True, grad_reduce_in_fp32: bool = True) -> list:
    """Wrap each GPTModel chunk in megatron DDP (fp32 grad buffers unless `grad_reduce_in_fp32` is False: the
    precision-aware optimizer's bf16 main grads); sets the config hooks the pipeline schedule uses
    (finalize_model_grads, no_sync)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                       disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def resolve_distributed_optimizer(setting: bool | None) -> bool:
    """``use_distributed_optimizer`` as given, or (None) on exactly when the data-parallel size is > 1:
    sharding the Adam state over the DP (x CP) ranks saves (DP-1)/DP of it per rank; with DP = 1 it saves nothing.
    Needs model parallel state (parallel.distributed.init_model_parallel)."""
    if setting is not None:
        return bool(setting)
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1


#: megatron's short dtype names (parallel.optim_config.MEGATRON_DTYPES) -> torch dtypes; fp8 moments are stored as
#: uint8 (Megatron-LM's dtype map)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


def megatron_optimizer_options(optim: OptimConfig) -> dict:
    """The OptimizerConfig keyword arguments of ``optim``'s megatron-core options: optimizer_cpu_offload,
    optimizer_offload_fraction, use_precision_aware_optimizer and the four *_dtype fields as torch dtypes."""
    out = {"optimizer_cpu_offload": bool(optim.optimizer_cpu_offload),
           "optimizer_offload_fraction": float(optim.optimizer_offload_fraction),
           "use_precision_aware_optimizer": bool(optim.use_precision_aware_optimizer)}
    for k in MEGATRON_DTYPES:
        out[k] = TORCH_DTYPES[megatron_dtype_name(getattr(optim, k))]
    return out


def check_megatron_optimizer_options(optim: OptimConfig, device: torch.device, role: str = "actor") -> None:
    """Refuse, naming the key, the megatron-core optimizer options `device` cannot run: ``optimizer_cpu_offload``
    off CUDA (megatron's HybridDeviceOptimizer runs its device part on CUDA streams; on the CPU the state is on the
    host already) and ``use_precision_aware_optimizer`` when Transformer Engine (its FusedAdam) is not installed.
    Raises ValueError."""
    import importlib.util

    at = f"{role}.optim."
    if optim.optimizer_cpu_offload and torch.device(device).type != "cuda":
        raise ValueError(f"{at}optimizer_cpu_offload=true needs a CUDA device (megatron's HybridDeviceOptimizer "
                         f"copies between CUDA streams); this role computes on {device}, where the optimizer state "
                         f"is on the host already: set {at}optimizer_cpu_offload=false")
    if optim.use_precision_aware_optimizer and importlib.util.find_spec("transformer_engine") is None:
        # megatron-core 0.16.1's OptimizerConfig reads Transformer Engine's version first (also with CPU offload)
        raise ValueError(f"{at}use_precision_aware_optimizer=true needs Transformer Engine (its FusedAdam; not "
                         f"installed); install transformer_engine or set {at}use_precision_aware_optimizer=false")


def build_train_state(chunks, config, optim: OptimConfig, guard: StepGuardConfig | None = None,
                      role: str = "actor") -> TrainState:
    """DDP-wrap `chunks` and build the megatron optimizer, the LR scheduler and the step guard.

    guard: skip/breaker settings (default: `optim.max_consecutive_skipped_steps` and `optim.breaker`);
    role names the owner in errors.  ``optim.use_distributed_optimizer`` None: see
    :func:`resolve_distributed_optimizer`.
    Raises ValueError for an unknown lr_decay_style or a bad guard setting.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from parallel.lr_schedule import build_scheduler

    if optim.lr_decay_style not in tuple(LRDecayStyle):
        raise ValueError(f"lr_decay_style={optim.lr_decay_style!r}: use one of {[s.value for s in LRDecayStyle]}")
    if guard is None:
        guard = StepGuardConfig(optim.max_consecutive_skipped_steps, optim.breaker)
    step_guard = StepGuard(guard, role, optim.lr_warmup_steps)
    # megatron's precision-aware optimizer runs only as a distributed optimizer (at any data-parallel size)
    use_dist_opt = True if optim.use_precision_aware_optimizer and optim.use_distributed_optimizer is None \
        else resolve_distributed_optimizer(optim.use_distributed_optimizer)
    check_megatron_optimizer_options(optim, distributed.compute_device(), role)
    model = wrap_ddp(chunks, config, use_dist_opt,
                     grad_reduce_in_fp32=megatron_dtype_name(optim.main_grads_dtype) == "fp32")
    opt_config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, use_distributed_optimizer=use_dist_opt,
        bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype, **megatron_optimizer_options(optim))
    optimizer = get_megatron_optimizer(opt_config, model)
    scheduler = build_scheduler(optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                                warmup_steps=optim.lr_warmup_steps, decay_steps=optim.lr_decay_steps,
                                decay_style=optim.lr_decay_style)
    scheduler.guard = step_guard
    return TrainState(model, optimizer, scheduler, step_guard)


def zero_grads(state: TrainState) -> None:
    for m in state.model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()


@torch.no_grad()
def guarded_megatron_step(optimizer) -> tuple[bool, float]:
    """megatron-core's ChainedOptimizer.step with a finite-grad-norm check before anything changes.

    Collective over the optimizer's grad-stats group: every rank sees the same global norm and takes
    the same decision.  Clips to `config.clip_grad` (when > 0) exactly as megatron does.
    Returns (stepped, grad_norm); grad_norm is inf when the fp16 grad scaler found an overflow.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # fp16 grad scaler overflow (megatron already lowered the scale)
        return False, math.inf
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return bool(optimizer.step_with_ready_grads()), grad_norm


def optimizer_step(state: TrainState) -> StepResult:
    """One guarded optimizer + scheduler step (collective over the role's ranks).

    A non-finite grad norm skips the step: weights, Adam moments and step count and the LR schedule
    are unchanged (bitwise); it is counted in `state.guard.num_skipped_steps` and the
    `max_consecutive_skipped_steps`-th skip in a row raises `SkippedStepsError`.  A finite step
    advances the scheduler and feeds the gradient circuit breaker (`StepResult.breaker`).
    """
    groups = state.optimizer.param_groups
    lr = float(groups[0]["lr"]) if groups else 0.0
    stepped, grad_norm = guarded_megatron_step(state.optimizer)
    if stepped:
        state.scheduler.step(increment=1)
    event = state.guard.record(grad_norm, not stepped, state.scheduler) if state.guard is not None else None
    return StepResult(skipped=not stepped, grad_norm=grad_norm, lr=lr, breaker=event)
