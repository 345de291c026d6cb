"""Single-field rules shared by the schema's sections: the :class:`Checked` base and the range helpers.

Each helper returns one line per bad key: ``"{at}{key}={value!r} {why}; {fix}."``.
"""
from __future__ import annotations

from typing import Any, Callable

from rlhf.config.errors import ConfigValidationError

__all__ = ["Checked", "rule", "ge", "gt", "ge_or_null", "gt_or_null", "steps_or_never", "sampling"]


class Checked:
    """Base of the schema's dataclasses: ``problems(at)`` lists the out-of-range values of this section
    (keys prefixed with ``at``), ``__post_init__`` raises them.  ``problems`` only reads attributes, so
    :func:`rlhf.config.schema.field_problems` can run it on an OmegaConf node of the dataclass's type."""

    def __post_init__(self) -> None:
        problems = type(self).problems(self)
        if problems:
            raise ConfigValidationError(problems)

    def problems(self, at: str = "") -> list[str]:
        return []


def rule(obj: Any, at: str, keys: str, ok: Callable[[Any], bool], must: str) -> list[str]:
    """``"{at}{key}={value!r} {must}."`` for each space-separated key in ``keys`` whose value fails ``ok``
    (None fails too)."""
    out = []
    for k in keys.split():
        v = getattr(obj, k)
        if v is None or not ok(v):
            out.append(f"{at}{k}={v!r} {must}.")
    return out


def ge(obj: Any, at: str, keys: str, lo: float, fix: str = "") -> list[str]:
    return rule(obj, at, keys, lambda v: v >= lo, f"must be >= {lo}" + (f"; {fix}" if fix else ""))


def gt(obj: Any, at: str, keys: str, lo: float, fix: str = "") -> list[str]:
    return rule(obj, at, keys, lambda v: v > lo, f"must be > {lo}" + (f"; {fix}" if fix else ""))


def ge_or_null(obj: Any, at: str, keys: str, fix: str) -> list[str]:
    return [f"{at}{k}={getattr(obj, k)!r} must be >= 1 (or null); {fix}." for k in keys.split()
            if getattr(obj, k) is not None and getattr(obj, k) < 1]


def gt_or_null(obj: Any, at: str, keys: str, fix: str) -> list[str]:
    return [f"{at}{k}={getattr(obj, k)!r} must be > 0 (or null); {fix}." for k in keys.split()
            if getattr(obj, k) is not None and getattr(obj, k) <= 0]


def steps_or_never(obj: Any, at: str, keys: str) -> list[str]:
    return rule(obj, at, keys, lambda v: v == -1 or v >= 1, "must be -1 (never) or a number of steps >= 1")


def sampling(obj: Any, at: str) -> list[str]:
    return (ge(obj, at, "temperature", 0, "0 is greedy")
            + rule(obj, at, "top_p", lambda v: 0 < v <= 1, "must be in (0, 1] (1.0 disables nucleus sampling)")
            + rule(obj, at, "top_k", lambda v: v == -1 or v >= 1, "must be -1 (disabled) or >= 1")
            + ge(obj, at, "n", 1))
