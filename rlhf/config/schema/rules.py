"""The schema's checks: :class:`Checked`, the base of its dataclasses, and the field helpers that declare a field's
range beside its default (``ppo_epochs: int = ge(1, 1)``).  A problem reads ``"{at}{key}={value!r} {must}."``."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rlhf.config.errors import ConfigValidationError

__all__ = ["Checked", "check", "ge", "gt", "ge1_or_null", "gt0_or_null", "steps_or_never", "SAMPLING"]


def check(default: Any, ok: Callable[[Any], bool], must: str, null: bool = False) -> Any:
    """A dataclass field with ``default`` whose value must pass ``ok``; None passes when ``null``.  ``must`` words
    the rule (``{at}`` in it: the section's prefix)."""
    return dataclasses.field(default=default, metadata={"ok": ok, "must": must, "null": null})


def ge(lo: float, default: Any, fix: str = "") -> Any:
    return check(default, lambda v: v >= lo, f"must be >= {lo}" + (f"; {fix}" if fix else ""))


def gt(lo: float, default: Any, fix: str = "") -> Any:
    return check(default, lambda v: v > lo, f"must be > {lo}" + (f"; {fix}" if fix else ""))


def ge1_or_null(default: Any, fix: str) -> Any:
    return check(default, lambda v: v >= 1, f"must be >= 1 (or null); {fix}", null=True)


def gt0_or_null(default: Any, fix: str) -> Any:
    return check(default, lambda v: v > 0, f"must be > 0 (or null); {fix}", null=True)


def steps_or_never(default: Any) -> Any:
    return check(default, lambda v: v == -1 or v >= 1, "must be -1 (never) or a number of steps >= 1")


#: the sampling settings' checks (rollout, rollout.val_kwargs): temperature, top_p, top_k, n
SAMPLING = ((lambda v: v >= 0, "must be >= 0; 0 is greedy"),
            (lambda v: 0 < v <= 1, "must be in (0, 1] (1.0 disables nucleus sampling)"),
            (lambda v: v == -1 or v >= 1, "must be -1 (disabled) or >= 1"), (lambda v: v >= 1, "must be >= 1"))


class Checked:
    """Base of the schema's dataclasses: ``problems(at)`` lists this section's bad values (keys prefixed with ``at``):
    each field's :func:`check` and the section's own ``rules(at)``; ``__post_init__`` raises them.  Both only read
    attributes, so :func:`rlhf.config.schema.field_problems` runs them on an OmegaConf node of the type too."""

    def __post_init__(self) -> None:
        problems = type(self).problems(self)
        if problems:
            raise ConfigValidationError(problems)

    def problems(self, at: str = "") -> list[str]:
        from omegaconf import OmegaConf

        kind = type(self) if dataclasses.is_dataclass(self) else OmegaConf.get_type(self)
        out = []
        for f in dataclasses.fields(kind):
            ok, must, null = (f.metadata.get(k) for k in ("ok", "must", "null"))
            v = getattr(self, f.name)
            if ok is not None and not (v is None and null) and (v is None or not ok(v)):
                out.append(f"{at}{f.name}={v!r} {must.format(at=at)}.")
        return out + kind.rules(self, at)

    def rules(self, at: str = "") -> list[str]:
        """The section's rules across its fields (none here)."""
        return []
