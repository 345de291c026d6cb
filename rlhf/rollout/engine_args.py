"""What an SGLang engine is started with: validated ``sglang.Engine`` kwargs, its process environment,
and the weights it will accept (from the checkpoint's safetensors headers, read before any engine starts)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from rlhf.rollout import sglang_cpu
from rlhf.rollout.engine_loader import LOADER

__all__ = ["engine_kwargs", "engine_env", "expected_weights_from_checkpoint", "engine_compute_dtype", "ENGINE_DTYPES"]

ENGINE_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                 "half": torch.float16, "bfloat16": torch.bfloat16}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_kwargs(model_path: str, tp_size: int = 1, dtype: str = "auto", mem_fraction_static: Optional[float] = None,
                  context_length: Optional[int] = None, random_seed: int = 0, log_level: str = "warning",
                  device: Optional[str] = None, max_total_tokens: Optional[int] = None,
                  enable_memory_saver: Optional[bool] = None, **overrides: Any) -> Dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for one rollout engine.

    Args:
        model_path: HF model directory (config, tokenizer, safetensors).
        tp_size: the engine's tensor-parallel size (independent of the trainer's TP).
        dtype: "auto" (checkpoint dtype), "float32", "bfloat16" or "float16".
        mem_fraction_static: SGLang's share of device memory for weights + KV cache (None: SGLang's default).
        context_length: max prompt + response tokens (None: the model's max_position_embeddings).
        device: "cpu", "cuda" or None (CPU exactly when CUDA is unavailable); on CPU the settings of
            :mod:`rlhf.rollout.sglang_cpu` are added.
        max_total_tokens: KV-cache tokens (on CPU default 2048).
        enable_memory_saver: SGLang's memory saver (release/resume free memory); None: on with CUDA.
        overrides: more ``sglang.Engine`` arguments, applied last (``custom_weight_loader`` entries are kept and
            :data:`rlhf.rollout.engine_loader.LOADER` is added: the weight sync's engine-layout path).
    Raises:
        ValueError: a bad value, named with the fix.
    """
    model_path = os.fspath(model_path)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"model_path {model_path!r} is not a HF model directory (no config.json)")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if dtype != "auto" and dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(ENGINE_DTYPES)}, got {dtype!r}")
    if mem_fraction_static is not None and not 0.0 < mem_fraction_static < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static!r}")
    if context_length is not None and context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {context_length!r}")
    on_cpu = sglang_cpu.use_cpu_engine(device)
    kw: Dict[str, Any] = dict(model_path=model_path, tp_size=tp_size, dtype=dtype, random_seed=int(random_seed),
                              log_level=log_level)
    if mem_fraction_static is not None and not on_cpu:
        kw["mem_fraction_static"] = float(mem_fraction_static)
    if context_length is not None:
        kw["context_length"] = int(context_length)
    if on_cpu:
        kw.update(sglang_cpu.cpu_engine_kwargs(max_total_tokens or 2048))
    else:
        kw["enable_memory_saver"] = True if enable_memory_saver is None else bool(enable_memory_saver)
        if max_total_tokens is not None:
            kw["max_total_tokens"] = int(max_total_tokens)
    loaders = list(overrides.pop("custom_weight_loader", None) or [])
    kw.update(overrides)
    # our loader of buckets written in the engine's parameter layout (rlhf.rollout.engine_loader)
    kw["custom_weight_loader"] = loaders + [LOADER] if LOADER not in loaders else loaders
    return kw


def engine_env(kwargs: Dict[str, Any]) -> Dict[str, str]:
    """Environment variables of the process that creates the engine (the Ray actor): on CPU the
    settings of :mod:`rlhf.rollout.sglang_cpu`; always this repository on PYTHONPATH (the actor
    imports ``rlhf``)."""
    env: Dict[str, str] = {}
    if kwargs.get("device") == "cpu":
        full = sglang_cpu.cpu_engine_env(int(kwargs.get("tp_size", 1)), base_env={})
        env.update(full)
    parts = [p for p in (env.get("PYTHONPATH", "") + os.pathsep + os.environ.get("PYTHONPATH", "")).split(os.pathsep)
             if p]
    if _REPO_ROOT not in parts:
        parts.append(_REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def expected_weights_from_checkpoint(model_path: str, dtype: str = "auto"
                                     ) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``{hf_name: (shape, dtype)}`` an engine started from ``model_path`` accepts in weight updates: the names
    and full shapes of the checkpoint's tensors (the model's ``load_weights`` was built from them; tied models
    list no ``lm_head.weight``), with the dtype the engine computes in for floating tensors: SGLang's own rule
    for ``dtype="auto"`` (config.json's dtype, except that float32 checkpoints run in float16).

    Raises:
        FileNotFoundError: no safetensors file in ``model_path``.
    """
    from parallel.convert.hf_io import read_checkpoint_metadata

    engine_dtype = engine_compute_dtype(model_path, dtype)
    return {n: (shape, engine_dtype if dt.is_floating_point else dt)
            for n, (shape, dt) in read_checkpoint_metadata(model_path).items()}


def engine_compute_dtype(model_path: str, dtype: str = "auto") -> torch.dtype:
    """The dtype SGLang runs the model in (its ``_get_and_verify_dtype`` on config.json)."""
    import json

    from sglang.srt.configs.model_config import _get_and_verify_dtype

    with open(os.path.join(model_path, "config.json")) as f:
        return _get_and_verify_dtype(json.load(f), dtype)
