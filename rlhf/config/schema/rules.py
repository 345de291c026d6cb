"""The schema's checks: a table (rules.yaml beside this module: each field's range, a section's rules across its
fields, the rules across sections) applied by :func:`rule_problems`; :class:`Checked`, the base of the schema's
dataclasses, applies a section's; :func:`field_problems` runs them on every section of a composed config."""
from __future__ import annotations

import dataclasses
import functools
import operator
from pathlib import Path
from typing import Any

from rlhf.config.errors import ConfigValidationError


@functools.lru_cache(maxsize=1)
def table() -> dict:
    """rules.yaml: ``fields`` and ``sections`` (``{schema class name: [rule, ...]}``), ``across`` (``[rule, ...]``),
    ``engine_owned`` (its header: the form)."""
    import yaml

    return yaml.safe_load(Path(__file__).with_name("rules.yaml").read_text(encoding="utf-8"))


#: the comparisons of a rule's condition, ``{OP: ARG}``
_OPS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le,
        "len": lambda v, n: hasattr(v, "__len__") and len(v) == n,
        "startswith": lambda v, prefixes: str(v).startswith(tuple(prefixes))}


def _holds(value: Any, want: Any, get: Any) -> bool:
    """A rule's condition on ``value``: a list holds for any item; a dict for all its items, ``not: X`` when X does
    not hold, ``gt|ge|lt|le: N`` for a number so compared (``$KEY``: the value of KEY, ``get(KEY)``), ``len: N`` for
    a string, list or dict of that length, ``startswith: [PREFIX, ...]`` (null fails them all); true / false / null
    for that very value; else when equal."""
    if isinstance(want, list):
        return any(_holds(value, w, get) for w in want)
    if isinstance(want, dict):
        return all(not _holds(value, arg, get) if op == "not" else value is not None and _OPS[op](
            value, get(arg[1:]) if isinstance(arg, str) and arg.startswith("$") else arg) for op, arg in want.items())
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
            if all(_holds(get(k), w, get) for k, w in r["if"].items())]


class Checked:
    """Base of the schema's dataclasses: :meth:`problems` lists a section's bad values, keys prefixed with ``at`` (the
    rules.yaml ``fields`` and ``sections`` rules of its class and base classes, then its :meth:`rules` in Python);
    ``__post_init__`` raises them.  All only read attributes, so :func:`field_problems` runs them on an OmegaConf node
    of the type too."""

    def __post_init__(self) -> None:
        if problems := type(self).problems(self):
            raise ConfigValidationError(problems)

    def problems(self, at: str = "") -> list[str]:
        from omegaconf import OmegaConf

        kind = type(self) if dataclasses.is_dataclass(self) else OmegaConf.get_type(self)
        return rule_problems(self, [r for part in ("fields", "sections") for c in reversed(kind.__mro__)
                                    for r in table()[part].get(c.__name__, [])], at) + kind.rules(self, at)

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
