"""Python values as Hydra override strings (rlhf.Trainer's arguments, the verl alias layer's rewrites)."""
from __future__ import annotations

import os
import re
from typing import Any


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
    if re.fullmatch(r"[A-Za-z0-9_./:@+-]+", s):  # a plain token (paths, hub names) that Hydra reads back as is
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            if OverridesParser.create().parse_overrides([f"k={s}"])[0].value() == s:
                return s
        except Exception:  # noqa: BLE001 - quoted below
            pass
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
