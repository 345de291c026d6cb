"""Hydra override strings: checking them before composing, and writing Python values as overrides.

:func:`check_overrides` parses the ``key=value`` lines with Hydra's grammar and applies each value to a copy of
the schema in struct mode, so OmegaConf itself checks the key and the value's type (and an Enum field its
choices); every unknown key and bad value is collected (:func:`rlhf.config.hydra_errors.translate` words them),
so all are reported together rather than Hydra's first one.
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from rlhf.config.errors import ConfigError, ConfigKeyError
from rlhf.config.hydra_errors import override_source, translate
from rlhf.config.keys import all_schema_paths, nearest_keys, schema

__all__ = ["CheckedOverrides", "check_overrides", "override_source", "format_value", "config_key"]

#: config groups selected by ``group=NAME`` overrides (and the defaults list of ppo_trainer.yaml)
GROUPS = ("recipe", "algorithm")


class CheckedOverrides(NamedTuple):
    """What :func:`check_overrides` found."""

    choices: dict  # group -> selected option names, in order (``{"recipe": ["quickstart"]}``)
    problems: list  # one line per bad value
    skip: list  # override lines left out when composing: bad values, unknown keys and ``group=null``
    unknown: list  # a ConfigKeyError per key that is not in the schema (all reported together)


def check_overrides(overrides: Sequence[str], sources: Optional[Mapping[str, str]] = None) -> CheckedOverrides:
    """Check ``overrides`` against the schema; ``sources`` names where a line came from (default: the
    command line).  What OmegaConf does not refuse here (a key inside a dict-valued field without ``+``, a
    sweep) is left to composing, which reports it.

    Raises:
        ConfigError: an override Hydra cannot parse, a package override (``key@pkg``) or the deletion of a
            schema key (``~key``).
    """
    import copy

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"Cannot parse command-line override: {e}\n"
                          "Overrides look like key=value, e.g. trainer.total_training_steps=10 or "
                          "data.train_files=[a.jsonl,b.jsonl].") from None
    out = CheckedOverrides({g: [] for g in GROUPS}, [], [], [])
    trial = copy.deepcopy(schema())  # the overrides land here first: OmegaConf checks keys and types
    OmegaConf.set_struct(trial, True)
    for ov in parsed:
        key, where = ov.key_or_group, (sources or {}).get(ov.input_line) or override_source(ov.input_line)
        if ov.package is not None:
            raise ConfigError(f"{where}: package overrides (key@pkg) are not supported.")
        if key == "hydra" or key.startswith("hydra."):
            continue
        if key in GROUPS and not ov.is_delete():
            if ov.value() is None:  # no recipe / no preset: the default
                out.skip.append(ov.input_line)
            else:
                out.choices[key].append(str(ov.value()))
            continue
        if ov.is_delete():
            raise ConfigError(f"{where}: keys of the schema cannot be deleted; "
                              f"set a value instead (e.g. {key}=null where the key allows None).")
        sweep = ov.value_type != ValueType.ELEMENT  # composing refuses a sweep; its key is checked here
        try:  # (``+key=value`` additions included: a key the schema lacks is unknown either way)
            OmegaConf.update(trial, key, None if sweep else ov.value(), merge=True)
        except Exception as e:  # noqa: BLE001 - what is not translated here, composing reports
            found = translate(e, where, key)
            if isinstance(found, ConfigKeyError):
                out.unknown.append(found)
            elif found is not None and not sweep:
                out.problems.extend(found.problems)
            else:
                continue
            out.skip.append(ov.input_line)
    return out


# --------------------------------------------------------------------------- Python values -> overrides


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
