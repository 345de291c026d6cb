"""Hydra / OmegaConf errors as short :class:`~rlhf.config.errors.ConfigError` messages: the key, where it came
from (recipe file, config file or command-line override), the nearest valid keys or choices, and no traceback.

The one place that reads their exceptions: checking overrides (:mod:`rlhf.config.overrides`), composing and
resolving (:mod:`rlhf.config.compose`) all turn what OmegaConf or Hydra raised into a message here.  OmegaConf's
exceptions carry the key (``full_key``) and the schema node (an ``EnumNode`` knows its choices); Hydra's name
the file or override in their text.
"""
from __future__ import annotations

import difflib
import re
from typing import Optional, Sequence

from rlhf.config.errors import ConfigError, ConfigKeyError, ConfigValidationError
from rlhf.config.keys import first_bad_part, nearest_keys, split_key, unknown_key_error

__all__ = ["translate", "config_error", "override_source"]

_GROUP_WORDS = {"recipe": ("recipe", "recipes"), "algorithm": ("algorithm preset", "algorithm presets")}


def override_source(line: str) -> str:
    return f"command-line override {line!r}"


def _chain(e: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return chain


def _source(e: BaseException, overrides: Sequence[str]) -> str:
    """Where a composition error came from, read from Hydra's message: a config file or an override."""
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


def _choices(c) -> Optional[tuple[type, bool]]:
    """(Enum type, accepts null) of the field, or list element, a ValidationError is about."""
    from omegaconf import ListConfig
    from omegaconf.nodes import EnumNode

    if isinstance(c.child_node, EnumNode):
        return c.child_node.enum_type, c.child_node._is_optional()
    element = c.parent_node._metadata.element_type if isinstance(c.parent_node, ListConfig) else None
    return (element, False) if isinstance(element, type) and hasattr(element, "__members__") else None


def translate(e: BaseException, source: str = "", key: str = "") -> Optional[ConfigError]:
    """An unknown key (:class:`ConfigKeyError`, with the nearest keys), a bad value or interpolation
    (:class:`ConfigValidationError`, one line) from what OmegaConf raised, anywhere in ``e``'s chain; None when
    the chain holds neither.  ``key``: the override being applied (OmegaConf names only the first missing part of
    an unknown key, and a key inside a merged list relative to the list element: ``key`` stands for those)."""
    from omegaconf.errors import ConfigKeyError as OCKeyError, InterpolationResolutionError
    from omegaconf.errors import ValidationError as OCValidationError

    chain = _chain(e)
    at = f" ({source})" if source else ""
    for c in chain:
        if isinstance(c, InterpolationResolutionError):
            first = str(c).splitlines()[0]
            m = re.search(r"Interpolation key '([^']+)' not found", first)
            near = nearest_keys(m.group(1)) if m else []
            return ConfigValidationError([f"{getattr(c, 'full_key', None) or '?'}: {first}{at}."
                                          + (f" Did you mean: {', '.join(near)}?" if near else "")])
    for c in chain:
        full_key = getattr(c, "full_key", None)
        if not full_key or (key and not full_key.startswith(key) and not key.startswith(full_key)):
            continue
        if isinstance(c, (OCKeyError, AttributeError)) and first_bad_part(split_key(full_key)) is not None:
            return unknown_key_error(key if key.startswith(full_key) else full_key, source)  # OmegaConf: 'a' of a.b
        if isinstance(c, OCValidationError):
            from rlhf.config.choices import choice_problem

            choices = _choices(c)
            if choices is not None:
                return ConfigValidationError([choice_problem(full_key, c.value, *choices) + at])
            return ConfigValidationError([f"{full_key}: {str(c).splitlines()[0]}{at}"])
    for c in chain:
        if key and isinstance(c, OCValidationError):
            return ConfigValidationError([f"{key}: {str(c).splitlines()[0]}{at}"])
    return None


def config_error(e: BaseException, overrides: Sequence[str] = ()) -> ConfigError:
    """Any Hydra/OmegaConf error of composing with ``overrides`` as a short ConfigError: an unknown recipe or
    preset (close names and all names), :func:`translate`'s messages, else Hydra's first line and the cause's."""
    from hydra.errors import MissingConfigException

    if isinstance(e, MissingConfigException) and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.partition("/")
        if group in _GROUP_WORDS:
            avail = list(e.options or [])
            close = difflib.get_close_matches(name, avail, n=3, cutoff=0.5)
            one, many = _GROUP_WORDS[group]
            return ConfigKeyError(f"Unknown {one} {name!r}." + (f" Did you mean: {', '.join(close)}?" if close else "")
                                  + f"\nAvailable {many}: {', '.join(avail) or '(none)'}",
                                  key=name, suggestions=close, source=f"{group}=")
    found = translate(e, _source(e, overrides))
    if found is not None:
        return found
    chain = _chain(e)
    first = str(e).split("\nConfig search path:")[0]
    if len(chain) > 1:
        first += f"\n{type(chain[-1]).__name__}: {str(chain[-1]).splitlines()[0] if str(chain[-1]) else ''}"
    return ConfigError(first)
