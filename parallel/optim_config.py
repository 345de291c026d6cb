"""Optimizer settings as a plain dataclass (no torch import): the argument of
:func:`parallel.optim.build_train_state`, and the training config's ``actor.optim`` / ``critic.optim``."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from parallel.step_guard import BreakerConfig, guard_problems


#: the dtype names megatron-core accepts for each precision-aware field (Megatron-LM's --main-grads-dtype, ...)
MEGATRON_DTYPES = {"main_grads_dtype": ("fp32", "bf16"), "main_params_dtype": ("fp32", "fp16"),
                   "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"), "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8")}
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "uint8": "fp8"}


def megatron_dtype_name(value) -> str:
    """A dtype given as ``fp32`` / ``bf16`` / ``float32`` / ``torch.bfloat16`` / ... -> megatron's short name
    (``fp32``, ``bf16``, ``fp16``, ``fp8``); other values as they are (refused by :meth:`OptimConfig.problems`)."""
    name = str(value).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


class LRDecayStyle(StrEnum):
    """constant keeps lr after warm-up; linear and cosine decay it to min_lr over lr_decay_steps"""

    def __reduce_ex__(self, protocol):  # pickles as a plain str: readers need not import this module
        return str, (self.value,)

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


@dataclass
class OptimConfig:
    """Adam settings (megatron's Adam is AdamW: weight_decay is decoupled) and the LR schedule
    (megatron's OptimizerParamScheduler: linear warm-up over ``lr_warmup_steps`` optimizer steps, then
    ``lr_decay_style`` from ``lr`` to ``min_lr`` over ``lr_decay_steps``; None: no decay), and the step
    guard (parallel.step_guard): a step with a non-finite grad norm is skipped and
    ``max_consecutive_skipped_steps`` skips in a row stop the run; the gradient circuit breaker (``breaker``)
    restarts the warm-up after ``breaker.steps`` consecutive steps with a grad norm above ``breaker.grad_norm``.

    Raises:
        ValueError: at construction, listing every out-of-range value (see :meth:`problems`).
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # shard the Adam state (and fp32 main params) over the data-parallel ranks (megatron's distributed optimizer);
    # null: on exactly when the data-parallel size is > 1 (where it saves memory; resumes bitwise either way)
    use_distributed_optimizer: Optional[bool] = None
    lr_warmup_steps: int = 0
    lr_decay_steps: Optional[int] = None
    lr_decay_style: LRDecayStyle = LRDecayStyle.constant
    max_consecutive_skipped_steps: int = 10  # this many skipped (inf/NaN grad norm) steps in a row stop the run
    breaker: BreakerConfig = field(default_factory=BreakerConfig)  # gradient circuit breaker
    # megatron-core's own optimizer options (verl: optim.override_optimizer_config.*): Adam's state and step on the
    # host for `optimizer_offload_fraction` of the parameters (HybridDeviceOptimizer: CUDA only), and the
    # precision-aware optimizer (Transformer Engine's FusedAdam, distributed optimizer) whose main grads / main
    # params / Adam moments may be kept in lower precision (the *_dtype names: MEGATRON_DTYPES)
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0  # megatron's default: 0 offloads nothing; 1 all of it
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"  # fp32 | bf16
    main_params_dtype: str = "fp32"  # fp32 | fp16
    exp_avg_dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8
    exp_avg_sq_dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8

    def __post_init__(self) -> None:
        self.lr_decay_style = LRDecayStyle(self.lr_decay_style)  # ValueError names the bad value
        for k in MEGATRON_DTYPES:
            setattr(self, k, megatron_dtype_name(getattr(self, k)))
        if isinstance(self.breaker, Mapping):
            self.breaker = BreakerConfig(**dict(self.breaker))
        problems = OptimConfig.problems(self) + self.breaker.problems("breaker.")
        if problems:
            raise ValueError("invalid OptimConfig: " + " ".join(problems))

    def problems(self, at: str = "") -> list[str]:
        """One line per out-of-range value, keys prefixed with ``at`` (e.g. ``"actor.optim."``).
        Works on an instance or on an OmegaConf node of this type (duck-typed ``self``)."""
        out = [f"{at}{k}={getattr(self, k)!r} must be >= 0."
               for k in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps", "lr_warmup_steps")
               if getattr(self, k) is None or getattr(self, k) < 0]
        out += [f"{at}{k}={getattr(self, k)!r} must be in [0, 1)." for k in ("adam_beta1", "adam_beta2")
                if getattr(self, k) is None or not 0 <= getattr(self, k) < 1]
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            out.append(f"{at}lr_decay_steps={self.lr_decay_steps!r} must be >= 1 (or null: no decay).")
        if isinstance(self.lr, (int, float)) and isinstance(self.min_lr, (int, float)) and self.min_lr > self.lr:
            out.append(f"{at}min_lr={self.min_lr} is above {at}lr={self.lr}; lower min_lr.")
        out += _megatron_problems(self, at)
        # the breaker's own problems: BreakerConfig.problems (the config checker visits that node itself)
        return out + guard_problems(self.max_consecutive_skipped_steps, None, at)


def _megatron_problems(o, at: str) -> list[str]:
    """megatron-core's own checks of the offload / precision-aware fields (OptimizerConfig.__post_init__ asserts),
    as config problems naming the key and the fix."""
    out = []
    for k, allowed in MEGATRON_DTYPES.items():
        v = megatron_dtype_name(getattr(o, k))
        if v not in allowed:
            out.append(f"{at}{k}={getattr(o, k)!r} must be one of {list(allowed)}.")
        elif v != "fp32" and not o.use_precision_aware_optimizer:
            out.append(f"{at}{k}={getattr(o, k)!r} needs {at}use_precision_aware_optimizer=true (megatron keeps "
                       f"main grads, main params and Adam moments in fp32 otherwise).")
    frac = o.optimizer_offload_fraction
    if frac is None or not 0 <= frac <= 1:
        out.append(f"{at}optimizer_offload_fraction={frac!r} must be in [0, 1].")
    elif o.optimizer_cpu_offload and frac == 0:
        out.append(f"{at}optimizer_cpu_offload=true with {at}optimizer_offload_fraction=0 offloads nothing; set the "
                   f"fraction of the optimizer state to keep on the host (1: all of it).")
    if o.use_precision_aware_optimizer and o.use_distributed_optimizer is False:
        out.append(f"{at}use_precision_aware_optimizer=true needs the distributed optimizer: set "
                   f"{at}use_distributed_optimizer=true or null (null: on whenever the precision-aware optimizer is).")
    return out
