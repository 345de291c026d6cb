"""The schema's checks: :class:`Checked`, the base of its dataclasses, and :func:`check` / :func:`ge` / :func:`gt`,
which declare a field's range beside its default (``ppo_epochs: int = ge(1, 1)``); the rules across keys, a table
(rules.yaml beside this module, applied by :func:`rule_problems`); :func:`field_problems` runs a section's checks and
rules on every section of a composed config.  A field's problem reads ``"{at}{key}={value!r} {must}."``."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
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


@functools.lru_cache(maxsize=1)
def table() -> dict:
    """rules.yaml: ``{"sections": {schema class name: [rule, ...]}, "across": [rule, ...]}`` (its header: the form)."""
    import yaml

    return yaml.safe_load(Path(__file__).with_name("rules.yaml").read_text(encoding="utf-8"))


def _holds(value: Any, want: Any) -> bool:
    """A rule's condition on ``value``: a list holds for any item, ``{not: X}`` when X does not, ``{gt|lt|le: N}``
    for a number so compared, true / false / null for that very value, anything else when equal."""
    if isinstance(want, list):
        return any(_holds(value, w) for w in want)
    if isinstance(want, dict):
        (op, arg), = want.items()
        if op == "not":
            return not _holds(value, arg)
        return value is not None and (value > arg if op == "gt" else value < arg if op == "lt" else value <= arg)
    return value is want if want is None or isinstance(want, bool) else value == want


class _Fields(dict):
    """``{at}`` and the fields of ``node`` (read when a problem names them), for ``str.format_map``."""

    def __init__(self, node: Any, at: str):
        super().__init__(at=at)
        self.node = node

    def __missing__(self, key: str) -> Any:
        return getattr(self.node, key)


def rule_problems(node: Any, rules: list, at: str = "") -> list[str]:
    """The problem line of each rule of rules.yaml in ``rules`` whose conditions all hold on ``node`` (a config, a
    section, a dataclass; keys under it), keys in the line prefixed with ``at``."""
    def get(key: str) -> Any:
        return functools.reduce(lambda n, part: getattr(n, part, None), key.split("."), node)

    return [r["then"].format_map(_Fields(node, at)) for r in rules
            if all(_holds(get(k), w) for k, w in r["if"].items())]


class Checked:
    """Base of the schema's dataclasses: :meth:`problems` lists a section's bad values, keys prefixed with ``at``
    (each field's :func:`check`, the section's rules of rules.yaml, then its :meth:`rules` in Python);
    ``__post_init__`` raises them.  All only read attributes, so :func:`field_problems` runs them on an OmegaConf node
    of the type too."""

    def __post_init__(self) -> None:
        if problems := type(self).problems(self):
            raise ConfigValidationError(problems)

    def problems(self, at: str = "") -> list[str]:
        from omegaconf import OmegaConf

        kind = type(self) if dataclasses.is_dataclass(self) else OmegaConf.get_type(self)
        return [f"{at}{f.name}={v!r} {f.metadata['must'].format(at=at)}." for f in dataclasses.fields(kind)
                if "ok" in f.metadata and not ((v := getattr(self, f.name)) is None and f.metadata["null"])
                and (v is None or not f.metadata["ok"](v))] + rule_problems(
            self, [r for c in kind.__mro__ for r in table()["sections"].get(c.__name__, [])], at) + kind.rules(self, at)

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
