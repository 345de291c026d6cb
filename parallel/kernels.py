"""Which fused kernels and which layer implementation (Transformer Engine or megatron's local spec)
this process uses: one decision, made from what is importable, with one warning per fallback.

megatron-core 0.16.1 needs a compiled extension for each fusion below and fails (at build or at the
first step) when the flag is on and the extension is missing, e.g. ``masked_softmax_fusion`` with the
local spec in bf16 calls ``scaled_masked_softmax_cuda``.  So a fusion is turned on only when its modules
import; otherwise the unfused torch path runs (same numerics up to rounding) and ONE warning lists
every fusion that fell back.  On CPU everything is unfused and nothing is warned.

Transformer Engine (fused attention without the s x s score matrix, fused norms/linears) is required on
GPU by default: without it the process stops with :class:`TransformerEngineMissingError`, naming the
install command.  Setting ``RLHF_ALLOW_NO_TE=1`` (or ``allow_no_te=True``) runs megatron's local spec
instead, after one loud warning; the local spec's attention stores b x heads x s x s probabilities per
layer (see :mod:`rlhf.memory_plan.planner`).

Every fallback is counted: :func:`kernel_metrics` gives ``mcore/fused_kernel_fallbacks`` (fusions
off because an extension is missing) and ``mcore/transformer_engine_missing`` (0/1) for the trainer's
step metrics.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

TE_INSTALL_COMMAND = "pip install --no-build-isolation -e '.[gpu]'"
ALLOW_NO_TE_ENV = "RLHF_ALLOW_NO_TE"
C_COMPILER = "<c compiler>"  # pseudo-requirement: $CC, cc, gcc or clang on PATH, and Python's headers

#: TransformerConfig flag -> the modules it needs (all of them), in megatron-core 0.16.1.
FUSION_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    # megatron.core.fusions.fused_softmax: the causal / masked / plain softmax kernels (local spec)
    "masked_softmax_fusion": ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                              "scaled_softmax_cuda"),
    # megatron.core.fusions.fused_bias_swiglu: torch.compile (inductor -> triton, which builds its launcher
    # with the system C compiler at the first call) of silu(a) * b
    "bias_activation_fusion": ("triton", C_COMPILER),
    # megatron.core.models.common.embeddings.rope_utils: Transformer Engine's fused RoPE
    "apply_rope_fusion": ("transformer_engine",),
    # megatron.core.tensor_parallel.layers: Apex's wgrad GEMM accumulating into main_grad (the
    # output layer is a megatron ColumnParallelLinear even under the TE spec, so TE alone is not enough)
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
}

logger = logging.getLogger(__name__)


class TransformerEngineMissingError(RuntimeError):
    """CUDA is available but Transformer Engine is not installed (and the fallback was not allowed)."""


def module_available(name: str) -> bool:
    """True when `import name` would find the module (nothing is imported); for `C_COMPILER`, whether a
    C compiler is on PATH."""
    if name == C_COMPILER:  # triton compiles its launcher against Python.h with the system compiler
        import shutil
        import sysconfig

        headers = os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
        return headers and any(shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c)
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class KernelChoice:
    """What `select_kernels` decided.

    use_te: Transformer Engine layer spec (else megatron's local spec).
    fusions: TransformerConfig flag -> on/off (the keys of FUSION_REQUIREMENTS).
    missing: flag -> the modules that were not importable (only fusions that fell back on GPU).
    warnings: the messages to emit once per process (empty on CPU and on a complete GPU install).
    """

    use_te: bool
    fusions: dict[str, bool]
    missing: dict[str, tuple[str, ...]] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    te_missing: bool = False  # on GPU without TE (the allowed fallback)


def _allowed_by_env(environ=None) -> bool:
    value = (os.environ if environ is None else environ).get(ALLOW_NO_TE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def select_kernels(cuda: bool, importable: Callable[[str], bool] = module_available, use_te: bool | None = None,
                   allow_no_te: bool | None = None, environ=None) -> KernelChoice:
    """Decide the layer spec and the fusions from what `importable` reports (pure: nothing is imported).

    Args:
        cuda: whether the model runs on CUDA.  False: local spec, every fusion off, no warning.
        importable: module name -> bool (default: `module_available`); tests pass a fake.
        use_te: force the Transformer Engine spec (True) or the local spec (False, no TE check); None: TE
            when importable.
        allow_no_te: run without TE on GPU (after a loud warning); None reads ``RLHF_ALLOW_NO_TE`` from
            `environ` (default os.environ).
    Raises:
        TransformerEngineMissingError: CUDA, TE not importable, and `use_te` is True or the fallback is
            not allowed; the message names the install command and ``RLHF_ALLOW_NO_TE=1``.
    """
    names = list(FUSION_REQUIREMENTS)
    if not cuda:
        if use_te:
            raise TransformerEngineMissingError("use_te=True needs CUDA; the CPU path uses megatron's local spec")
        return KernelChoice(use_te=False, fusions={n: False for n in names})
    warnings: list[str] = []
    te_ok = importable("transformer_engine")
    if not te_ok and use_te is not False:  # use_te=False: the local spec was asked for
        allow = _allowed_by_env(environ) if allow_no_te is None else allow_no_te
        if use_te or not allow:
            raise TransformerEngineMissingError(
                f"CUDA is available but Transformer Engine is not installed; install it with "
                f"`{TE_INSTALL_COMMAND}` (from the repository root), or set {ALLOW_NO_TE_ENV}=1 to run "
                f"megatron's slower local layers (unfused attention storing b x heads x s x s scores)")
        warnings.append(
            f"!!! Transformer Engine is NOT installed: running megatron's local layer spec (unfused attention, "
            f"more memory, slower) because {ALLOW_NO_TE_ENV} is set. Install it with `{TE_INSTALL_COMMAND}`. !!!")
    chosen_te = te_ok if use_te is None else bool(use_te)
    fusions, missing = {}, {}
    for name in names:
        absent = tuple(m for m in FUSION_REQUIREMENTS[name] if not importable(m))
        fusions[name] = not absent
        if absent:
            missing[name] = absent
    if missing:
        listed = ", ".join(f"{n} (needs {' + '.join(m)})" for n, m in missing.items())
        warnings.append(f"fused kernels unavailable, using the unfused torch path for: {listed}")
    return KernelChoice(use_te=chosen_te, fusions=fusions, missing=missing, warnings=tuple(warnings),
                        te_missing=not te_ok and use_te is None)


_WARNED: set[str] = set()


def emit_warnings(choice: KernelChoice) -> int:
    """Log each of `choice.warnings` once per process; returns how many were logged now."""
    n = 0
    for w in choice.warnings:
        if w not in _WARNED:
            _WARNED.add(w)
            logger.warning(w)
            n += 1
    return n


@functools.lru_cache(maxsize=None)
def _resolve(cuda: bool, allow: bool, use_te: bool | None) -> KernelChoice:
    return select_kernels(cuda, use_te=use_te, allow_no_te=allow)


def resolve_kernels(use_te: bool | None = None) -> KernelChoice:
    """This process's choice (cached): CUDA from torch, modules from the environment, warnings emitted once.

    use_te as in `select_kernels`.  Raises TransformerEngineMissingError as `select_kernels` does.
    """
    import torch

    choice = _resolve(torch.cuda.is_available(), _allowed_by_env(), use_te)
    emit_warnings(choice)
    return choice


def kernel_metrics(choice: KernelChoice | None = None) -> dict[str, float]:
    """Fallback counters for the step metrics: ``mcore/fused_kernel_fallbacks`` (number of fusions off for
    a missing extension) and ``mcore/transformer_engine_missing`` (1 when running without TE on GPU)."""
    choice = resolve_kernels() if choice is None else choice
    return {"mcore/fused_kernel_fallbacks": float(len(choice.missing)),
            "mcore/transformer_engine_missing": float(choice.te_missing)}
