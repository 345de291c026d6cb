"""The schema's checks: :class:`Checked`, the base of its dataclasses, and :func:`check` / :func:`ge` / :func:`gt`,
which declare a field's range beside its default (``ppo_epochs: int = ge(1, 1)``); :func:`field_problems` runs them
all on a composed config.  A problem reads ``"{at}{key}={value!r} {must}."``."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rlhf.config.errors import ConfigValidationError


def check(default: Any, ok: Callable[[Any], bool], must: str, null: bool = False) -> Any:
    """A dataclass field with ``default`` whose value must pass ``ok`` (None passes when ``null``); ``must`` words
    the rule (``{at}`` in it: the section's prefix)."""
    return dataclasses.field(default=default, metadata={"ok": ok, "must": must, "null": null})


def ge(lo: float, default: Any, fix: str = "", null: bool = False) -> Any:
    """:func:`check` of ``value >= lo`` (``null``: or None); ``fix`` follows the rule."""
    return check(default, lambda v: v >= lo, f"must be >= {lo}{' (or null)' * null}{f'; {fix}' * bool(fix)}", null)


def gt(lo: float, default: Any, fix: str = "", null: bool = False) -> Any:
    """:func:`check` of ``value > lo``, as :func:`ge`."""
    return check(default, lambda v: v > lo, f"must be > {lo}{' (or null)' * null}{f'; {fix}' * bool(fix)}", null)


class Checked:
    """Base of the schema's dataclasses: :meth:`problems` lists a section's bad values, keys prefixed with ``at``
    (each field's :func:`check`, then the section's :meth:`rules` across its fields); ``__post_init__`` raises them.
    Both only read attributes, so :func:`field_problems` runs them on an OmegaConf node of the type too."""

    def __post_init__(self) -> None:
        if problems := type(self).problems(self):
            raise ConfigValidationError(problems)

    def problems(self, at: str = "") -> list[str]:
        from omegaconf import OmegaConf

        kind = type(self) if dataclasses.is_dataclass(self) else OmegaConf.get_type(self)
        return [f"{at}{f.name}={v!r} {f.metadata['must'].format(at=at)}." for f in dataclasses.fields(kind)
                if "ok" in f.metadata and not ((v := getattr(self, f.name)) is None and f.metadata["null"])
                and (v is None or not f.metadata["ok"](v))] + kind.rules(self, at)

    def rules(self, at: str = "") -> list[str]:
        """The section's rules across its fields (none here)."""
        return []


def field_problems(node: Any, at: str = "") -> list[str]:
    """Every single-section problem of a composed config (a DictConfig typed by the schema): each section's
    :meth:`Checked.problems` on the config's nodes, in schema order, keys in full."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    check_ = getattr(OmegaConf.get_type(node), "problems", None)
    out = check_(node, at) if check_ else []
    for k in node.keys():
        child = node[k]
        items = [(f"{at}{k}.", child)] if isinstance(child, DictConfig) else [
            (f"{at}{k}[{i}].", c) for i, c in enumerate(child) if isinstance(c, DictConfig)] \
            if isinstance(child, ListConfig) else []
        out += [p for sub, c in items for p in field_problems(c, sub)]
    return out
