"""Data: GSM8K preprocessing, RL prompt datasets (local files, hub datasets, in-process datasets) with a
resumable loader, padding, and offline preference pairs.  (The embedded arithmetic task lives in :mod:`rlhf.quickstart.arithmetic`.)

Public API (imported lazily so ``import rlhf.data`` stays cheap)::

    rlhf.data.gsm8k:      preprocess_gsm8k, gsm8k_row, extract_gsm8k_ground_truth, make_prompt_text,
                          load_gsm8k_raw, default_local_gsm8k_dir, INSTRUCTION
    rlhf.data.rl_dataset: RLHFDataset (alias RLDataset), load_rl_dataset
    rlhf.data.loader:     StatefulPromptLoader
    rlhf.data.collate:    pad_sequences, position_ids_from_mask, collate_left_pad, collate_prompts
    rlhf.data.files:      resolve_data_files, read_rows
    rlhf.data.sources:    iter_rows (local files, hub datasets, object:// datasets), source_label
    rlhf.data.build:      build_rl_dataset (from the config's data section, tokenised once by rank 0),
                          overlong_policy, needs_ground_truth
    rlhf.data.prompts:    normalize_row, render_prompt
    rlhf.data.preference: load_preference_dataset, write_preference_parquet, encode_preference_pair,
                          encode_preference_pairs
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
    "RLHFDataset": "rl_dataset",
    "RLDataset": "rl_dataset",
    "load_rl_dataset": "rl_dataset",
    "StatefulPromptLoader": "loader",
    "pad_sequences": "collate",
    "position_ids_from_mask": "collate",
    "collate_left_pad": "collate",
    "collate_prompts": "collate",
    "resolve_data_files": "files",
    "iter_rows": "sources",
    "source_label": "sources",
    "build_rl_dataset": "build",
    "overlong_policy": "build",
    "needs_ground_truth": "build",
    "read_rows": "files",
    "normalize_row": "prompts",
    "render_prompt": "prompts",
    "load_preference_dataset": "preference",
    "write_preference_parquet": "preference",
    "encode_preference_pair": "preference",
    "encode_preference_pairs": "preference",
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
