"""Models built by the project itself (no downloads).

Public API (imported lazily so ``import rlhf.models`` stays cheap)::

    rlhf.models.tiny:   make_tiny_tokenizer, save_tiny_tokenizer, make_tiny_hf_model, build_tiny_hf_model,
                        TINY_CONFIGS
    rlhf.models.warmup: build_quickstart_model, resolve_model_path, quickstart_task_kwargs,
                        make_quickstart_tokenizer, evaluate_model, QUICKSTART_TASK, QUICKSTART_DEFAULTS
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "make_tiny_tokenizer": "tiny",
    "save_tiny_tokenizer": "tiny",
    "make_tiny_hf_model": "tiny",
    "build_tiny_hf_model": "tiny",
    "TINY_CONFIGS": "tiny",
    "build_quickstart_model": "warmup",
    "resolve_model_path": "warmup",
    "quickstart_task_kwargs": "warmup",
    "make_quickstart_tokenizer": "warmup",
    "evaluate_model": "warmup",
    "QUICKSTART_TASK": "warmup",
    "QUICKSTART_DEFAULTS": "warmup",
    "QUICKSTART_SCHEME": "warmup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'rlhf.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
