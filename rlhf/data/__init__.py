"""Data: GSM8K preprocessing, the embedded arithmetic task, RL prompt datasets with a
resumable loader, and offline preference pairs.

Public API (imported lazily so ``import rlhf.data`` stays cheap)::

    rlhf.data.gsm8k:      preprocess_gsm8k, gsm8k_row, extract_gsm8k_ground_truth, make_prompt_text,
                          load_gsm8k_raw, default_local_gsm8k_dir, INSTRUCTION
    rlhf.data.rl_dataset: RLDataset, load_rl_dataset, collate_left_pad, StatefulPromptLoader
    rlhf.data.synthetic:  make_arithmetic_dataset, write_arithmetic_parquet, make_arithmetic_problem
    rlhf.data.preference: load_preference_dataset, make_synthetic_preference_dataset,
                          write_preference_parquet, encode_preference_pair
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "preprocess_gsm8k": "gsm8k",
    "gsm8k_row": "gsm8k",
    "extract_gsm8k_ground_truth": "gsm8k",
    "make_prompt_text": "gsm8k",
    "load_gsm8k_raw": "gsm8k",
    "default_local_gsm8k_dir": "gsm8k",
    "INSTRUCTION": "gsm8k",
    "RLDataset": "rl_dataset",
    "load_rl_dataset": "rl_dataset",
    "collate_left_pad": "rl_dataset",
    "StatefulPromptLoader": "rl_dataset",
    "make_arithmetic_dataset": "synthetic",
    "make_arithmetic_problem": "synthetic",
    "write_arithmetic_parquet": "synthetic",
    "load_preference_dataset": "preference",
    "make_synthetic_preference_dataset": "preference",
    "write_preference_parquet": "preference",
    "encode_preference_pair": "preference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'rlhf.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
