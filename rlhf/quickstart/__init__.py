"""Quickstart fixtures: everything ``model.path=tiny://quickstart`` and ``data.*_files=embedded://...``
need, so the pipeline runs on a laptop CPU with no download.  The core build path reaches them only
through the hook in :mod:`rlhf.quickstart.resolve` (``resolve_model(cfg)``, ``resolve_data(cfg, split)``).

Modules::

    rlhf.quickstart.resolve:    resolve_model, resolve_data (the hook: quickstart URIs -> plain paths)
    rlhf.quickstart.tiny:       make_tiny_tokenizer, save_tiny_tokenizer, build_tiny_hf_model,
                                make_tiny_hf_model, TINY_CONFIGS (also the tests' tiny models)
    rlhf.quickstart.model:      build_quickstart_model, resolve_model_path, QUICKSTART_DEFAULTS
    rlhf.quickstart.tokenizer:  make_quickstart_tokenizer, prompt_ids, encode_example
    rlhf.quickstart.sft:        sft_warmup, response_loss, corrupt_answers
    rlhf.quickstart.evaluate:   evaluate_model
    rlhf.quickstart.arithmetic: make_arithmetic_dataset, write_arithmetic_parquet, quickstart_task_kwargs,
                                make_synthetic_preference_dataset, QUICKSTART_TASK

Names are imported lazily so ``import rlhf.quickstart`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "resolve_model": "resolve",
    "resolve_data": "resolve",
    "make_tiny_tokenizer": "tiny",
    "save_tiny_tokenizer": "tiny",
    "make_tiny_hf_model": "tiny",
    "build_tiny_hf_model": "tiny",
    "TINY_CONFIGS": "tiny",
    "build_quickstart_model": "model",
    "resolve_model_path": "model",
    "QUICKSTART_DEFAULTS": "model",
    "QUICKSTART_SCHEME": "model",
    "make_quickstart_tokenizer": "tokenizer",
    "evaluate_model": "evaluate",
    "quickstart_task_kwargs": "arithmetic",
    "QUICKSTART_TASK": "arithmetic",
    "make_arithmetic_dataset": "arithmetic",
    "make_arithmetic_problem": "arithmetic",
    "write_arithmetic_parquet": "arithmetic",
    "make_synthetic_preference_dataset": "arithmetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'rlhf.quickstart' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
