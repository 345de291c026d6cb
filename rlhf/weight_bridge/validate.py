"""Validation of a weight sync against the weights the engine expects, before anything is sent.

SGLang silently ignores an unknown name and kills its scheduler on a wrong shape, so every name and
shape is checked here first, and engine weights nothing maps to are refused too (they would keep stale
values).  Pure functions.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Mapping, Sequence

import torch

from rlhf.weight_bridge.bucketing import dtype_from_any

__all__ = ["WeightBridgeError", "normalize_expected", "validate_against_expected"]


class WeightBridgeError(RuntimeError):
    """A weight sync was refused or failed; the message names the offending tensor(s)."""


def normalize_expected(expected: Mapping) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """``{name: (shape tuple, torch.dtype or None)}`` from ``{name: (shape, dtype)}``, ``{name: shape}``
    or ``{name: {"shape", "dtype"}}`` (dtype names like "bfloat16" accepted)."""
    out = {}
    for name, val in expected.items():
        if isinstance(val, Mapping):
            shape, dt = val.get("shape"), val.get("dtype")
        elif isinstance(val, (tuple, list)) and len(val) == 2 and isinstance(val[0], (tuple, list, torch.Size)):
            shape, dt = val
        else:
            shape, dt = val, None
        out[name] = (tuple(int(s) for s in shape), None if dt is None else dtype_from_any(dt))
    return out


def validate_against_expected(stage_tensors: Mapping[int, Sequence[tuple[str, tuple, Any]]], expected: Mapping,
                              tie_word_embeddings: bool, engine: str = "engine",
                              allow_missing: Callable[[str], bool] | None = None) -> list[str]:
    """Check the tensors every pipeline stage would send against the engine's expected weights.

    Args:
        stage_tensors: ``{pp_rank: [(HF name, shape, dtype), ...]}``.
        expected: ``{HF name: (shape, dtype)}`` of the engine.
        tie_word_embeddings: the model ties lm_head to embed_tokens (then ``lm_head.weight`` may stay unsent).
        allow_missing: predicate on engine names that may stay unsent.
    Returns:
        one line per problem (empty when everything matches): a name the engine does not have (with the
        closest expected names), a shape differing from the engine's, a name sent by two stages, an engine
        weight nothing maps to.
    """
    exp = normalize_expected(expected)
    problems, owner = [], {}
    for pp_rank in sorted(stage_tensors):
        for name, shape, _dt in stage_tensors[pp_rank]:
            shape = tuple(int(s) for s in shape)
            if name in owner:
                problems.append(f"weight {name!r} would be sent twice (from pipeline stage {owner[name]} and again "
                                f"from stage {pp_rank}): two trainer tensors map to it")
            owner.setdefault(name, pp_rank)
            if name not in exp:
                close = difflib.get_close_matches(name, list(exp), n=3, cutoff=0.6)
                problems.append(f"weight {name!r} (shape {shape}, pipeline stage {pp_rank}) is not a weight of "
                                f"{engine} (SGLang would silently ignore it); closest expected names: {close}")
            elif exp[name][0] != shape:
                problems.append(f"weight {name!r}: the bridge would send shape {shape} but {engine} expects "
                                f"{exp[name][0]} (SGLang would crash on it)")
    for name, (shape, _dt) in exp.items():
        tied = name == "lm_head.weight" and tie_word_embeddings
        if name not in owner and not tied and not (allow_missing and allow_missing(name)):
            problems.append(f"{engine} expects weight {name!r} (shape {shape}) but no trainer tensor maps to it: "
                            f"it would keep stale values")
    return problems
