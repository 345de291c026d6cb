"""Python values as Hydra override strings (rlhf.Trainer's keyword arguments, the verl alias layer's rewrites)."""
from __future__ import annotations

import os
import re
from typing import Any

from rlhf.config.keys import all_schema_paths, nearest_keys

__all__ = ["format_value", "config_key"]


def format_value(v: Any) -> str:
    """A Python value as a Hydra override value (strings quoted, so any path is taken literally)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{format_value(x)}" for k, x in v.items()) + "}"
    s = os.fspath(v) if isinstance(v, os.PathLike) else str(v)
    if re.fullmatch(r"[A-Za-z0-9_./:@+-]+", s) and _parses_as(s, s):
        return s  # plain token (paths, hub names): no quotes, shell friendly
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _parses_as(raw: str, expected: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides([f"k={raw}"])[0].value() == expected
    except Exception:  # noqa: BLE001
        return False


def config_key(name: str) -> str:
    """Dotted config key for a keyword name: dotted (``"actor.optim.lr"``), with double underscores
    (``actor__optim__lr``) or a leaf name that occurs once in the schema (``total_training_steps``).

    Raises:
        TypeError: an ambiguous leaf name (lists the candidates) or an unknown one (with suggestions).
    """
    key = name.replace("__", ".")
    paths = all_schema_paths()
    if "." in key or key in paths:
        return key  # checked (with suggestions) when the config is composed
    found = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    if len(found) == 1:
        return found[0]
    if found:
        raise TypeError(f"Trainer: keyword {name!r} is ambiguous; use one of {found} "
                        f"(e.g. **{{{found[0]!r}: ...}} or {found[0].replace('.', '__')}=...)")
    near = nearest_keys(key)
    raise TypeError(f"Trainer: unknown keyword {name!r}" + (f"; did you mean {near}?" if near else ""))
