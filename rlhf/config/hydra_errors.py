"""Hydra / OmegaConf composition errors as short :class:`~rlhf.config.errors.ConfigError` messages: the
key, where it came from (recipe file or command-line override) and the fix, without Hydra's traceback."""
from __future__ import annotations

import difflib
import re
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, ListConfig

from rlhf.config.errors import ConfigError, ConfigKeyError, ConfigValidationError
from rlhf.config.keys import first_bad_part, nearest_keys, schema_node, split_key, unknown_key_error
from rlhf.config.overrides import override_source

__all__ = ["translate_hydra_error", "first_unresolvable_key"]

_GROUP_WORDS = {"recipe": ("recipe", "recipes"), "algorithm": ("algorithm preset", "algorithm presets")}


def _exception_chain(e: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return chain


def _composition_source(e: BaseException, overrides: Sequence[str]) -> str:
    m = re.search(r"In '([^']+)'", str(e))
    if m:
        return f"in {m.group(1)}.yaml"
    m = re.search(r"Error merging override (\S+)", str(e))
    if m and m.group(1) in overrides:
        return override_source(m.group(1))
    m = re.search(r"Could not override '([^']+)'", str(e))
    if m:
        for line in overrides:
            if line.split("=", 1)[0].lstrip("+~") == m.group(1):
                return override_source(line)
    return ""


def _unknown_option(msg: str) -> Optional[ConfigKeyError]:
    """``Could not find 'recipe/NAME'`` -> the unknown recipe (or preset), close names and all names."""
    m = re.search(r"Could not find '(recipe|algorithm)/([^']+)'", msg)
    if not m:
        return None
    group, name = m.groups()
    am = re.search(rf"Available options in '{group}':\n((?:\t[^\n]*\n?)*)", msg)
    avail = [s.strip() for s in am.group(1).splitlines() if s.strip()] if am else []
    close = difflib.get_close_matches(name, avail, n=3, cutoff=0.5)
    one, many = _GROUP_WORDS[group]
    return ConfigKeyError(f"Unknown {one} {name!r}." + (f" Did you mean: {', '.join(close)}?" if close else "")
                          + f"\nAvailable {many}: {', '.join(avail) or '(none)'}",
                          key=name, suggestions=close, source=f"{group}=")


def _bad_value(c: Any, source: str) -> ConfigValidationError:
    """An OmegaConf ValidationError (wrong type, not a member of the field's Enum) for ``c.full_key``."""
    from omegaconf import OmegaConf

    from rlhf.config.choices import choice_problem, choice_type

    *parent, leaf = split_key(c.full_key)
    node = schema_node(parent)
    choice = choice_type(OmegaConf.get_type(node), leaf) if node is not None and "[" not in c.full_key else None
    if choice is not None and getattr(c, "value", None) is not None:
        return ConfigValidationError([choice_problem(c.full_key, c.value, choice[0], choice[1])
                                      + (f" ({source})" if source else "")])
    first = str(c).splitlines()[0]
    return ConfigValidationError([f"{c.full_key}: {first}" + (f" ({source})" if source else "")])


def translate_hydra_error(e: BaseException, overrides: Sequence[str]) -> ConfigError:
    """Turn a Hydra/OmegaConf composition error into a short ConfigError."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigKeyError as OCKeyError, InterpolationResolutionError
    from omegaconf.errors import ValidationError as OCValidationError

    chain = _exception_chain(e)
    source = _composition_source(e, overrides)
    if isinstance(e, MissingConfigException):
        return _unknown_option(str(e)) or ConfigError(str(e).split("\nConfig search path:")[0])
    for c in chain:
        if isinstance(c, InterpolationResolutionError):
            full_key = getattr(c, "full_key", None) or "?"
            first = str(c).splitlines()[0]
            m = re.search(r"Interpolation key '([^']+)' not found", first)
            hint = ""
            if m and first_bad_part(split_key(m.group(1))) is not None:
                near = nearest_keys(m.group(1))
                hint = f" Did you mean: {', '.join(near)}?" if near else ""
            return ConfigValidationError([f"{full_key}: {first}" + (f" ({source})" if source else "") + "." + hint])
    for c in chain:
        if isinstance(c, (OCKeyError, AttributeError)) and getattr(c, "full_key", None):
            if first_bad_part(split_key(c.full_key)) is not None:
                return unknown_key_error(c.full_key, source)
    for c in chain:
        if isinstance(c, OCValidationError) and getattr(c, "full_key", None):
            return _bad_value(c, source)
    first = str(e).split("\nConfig search path:")[0]
    cause = chain[-1] if len(chain) > 1 else None
    if cause is not None:
        first += f"\n{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return ConfigError(first)


def first_unresolvable_key(cfg: DictConfig) -> Optional[str]:
    """Full key of the first value whose ``${...}`` interpolation fails to resolve (None if all do)."""
    from omegaconf.errors import OmegaConfBaseException

    def walk(node: Any, prefix: str) -> Optional[str]:
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for k in keys:
            if not prefix:
                full = str(k)
            else:
                full = f"{prefix}.{k}" if isinstance(node, DictConfig) else f"{prefix}[{k}]"
            try:
                child = node[k]
            except OmegaConfBaseException:
                return full
            if isinstance(child, (DictConfig, ListConfig)):
                found = walk(child, full)
                if found:
                    return found
        return None

    return walk(cfg, "")
