"""Hydra override strings: checking them before composing, and writing Python values as overrides.

:func:`check_overrides` parses the ``key=value`` lines with Hydra's grammar and checks each key against
the schema (an unknown key raises at once, with suggestions) and each value against its field's type,
collecting every bad value (wrong type, not one of an Enum's members) so all are reported together.
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from rlhf.config.errors import ConfigError
from rlhf.config.keys import all_schema_paths, first_bad_part, nearest_keys, schema_node, split_key, unknown_key_error

__all__ = ["CheckedOverrides", "check_overrides", "override_source", "format_value", "config_key"]

#: config groups selected by ``group=NAME`` overrides (and the defaults list of ppo_trainer.yaml)
GROUPS = ("recipe", "algorithm")


class CheckedOverrides(NamedTuple):
    """What :func:`check_overrides` found."""

    choices: dict  # group -> selected option names, in order (``{"recipe": ["quickstart"]}``)
    problems: list  # one line per bad value
    skip: list  # override lines left out when composing: bad values, unknown keys and ``group=null``
    unknown: list  # a ConfigKeyError per key that is not in the schema (all reported together)


def override_source(line: str) -> str:
    return f"command-line override {line!r}"


def check_overrides(overrides: Sequence[str], sources: Optional[Mapping[str, str]] = None) -> CheckedOverrides:
    """Check ``overrides`` against the schema; ``sources`` names where a line came from (default: the
    command line).

    Raises:
        ConfigError: an override Hydra cannot parse, a package override (``key@pkg``) or the deletion of a
            schema key (``~key``).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"Cannot parse command-line override: {e}\n"
                          "Overrides look like key=value, e.g. trainer.total_training_steps=10 or "
                          "data.train_files=[a.jsonl,b.jsonl].") from None
    out = CheckedOverrides({g: [] for g in GROUPS}, [], [], [])

    def where(line: str) -> str:
        return (sources or {}).get(line) or override_source(line)

    for ov in parsed:
        key = ov.key_or_group
        if ov.package is not None:
            raise ConfigError(f"{where(ov.input_line)}: package overrides (key@pkg) are not supported.")
        if key == "hydra" or key.startswith("hydra."):
            continue
        if key in GROUPS and not ov.is_delete():
            if ov.value() is None:  # no recipe / no preset: the default
                out.skip.append(ov.input_line)
            else:
                out.choices[key].append(str(ov.value()))
            continue
        if ov.is_delete():
            raise ConfigError(f"{where(ov.input_line)}: keys of the schema cannot be deleted; "
                              f"set a value instead (e.g. {key}=null where the key allows None).")
        if first_bad_part(split_key(key)) is not None:  # (``+key=value`` additions included)
            out.unknown.append(unknown_key_error(key, where(ov.input_line)))
            out.skip.append(ov.input_line)
            continue
        if ov.value_type == ValueType.ELEMENT and "[" not in key:
            problem = _value_problem(key, ov.value(), where(ov.input_line))
            if problem:
                out.problems.append(problem)
                out.skip.append(ov.input_line)
    return out


def _value_problem(key: str, value: Any, source: str) -> str:
    """The problem with setting schema key ``key`` to ``value`` ("" when OmegaConf accepts it)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from rlhf.config.choices import choice_problem, choice_type

    *parent, leaf = split_key(key)
    section = schema_node(parent)
    if section is None or OmegaConf.get_type(section) is dict:  # inside an Any or dict-valued field
        return ""
    section = OmegaConf.get_type(section)
    node = OmegaConf.structured(section)
    try:
        OmegaConf.update(node, leaf, value, merge=True)  # as Hydra applies an override
        return ""
    except ValidationError as e:
        choice = choice_type(section, leaf)
        if choice is None:
            return f"{key}: {str(e).splitlines()[0]} ({source})"
        enum, optional, is_list = choice
        if not is_list:
            return choice_problem(key, value, enum, optional)
        i, bad = next((i, v) for i, v in enumerate(value) if str(v) not in enum.__members__)
        return choice_problem(f"{key}[{i}]", bad, enum)
    except Exception:  # noqa: BLE001  (anything else: Hydra reports it while composing)
        return ""


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
