"""Python values as Hydra override strings (rlhf.Trainer's arguments, the verl alias layer's rewrites)."""
from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["format_value"]


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
