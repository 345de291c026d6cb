"""Keys of the structured schema, and the "did you mean" error for a key that is not one of them.

A misspelled or removed key, on the command line or in a recipe file, raises :class:`ConfigKeyError`
naming the key, where it came from, the nearest valid keys (close names at the same level, or the same
name in another section, e.g. verl's ``actor_rollout_ref.actor.clip_ratio`` for ``actor.clip_ratio``)
and the valid keys of its section.
"""
from __future__ import annotations

import difflib
import functools
import re
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from rlhf.config.errors import ConfigKeyError

__all__ = ["schema", "schema_node", "schema_keys", "all_schema_paths", "split_key", "first_bad_part", "is_dict_field",
           "is_optional", "nearest_keys", "unknown_key_error"]


@functools.lru_cache(maxsize=1)
def schema() -> DictConfig:
    """The schema with its defaults (:class:`~rlhf.config.schema.RLHFConfig`), built once; do not modify."""
    from rlhf.config.schema import RLHFConfig

    return OmegaConf.structured(RLHFConfig)


def schema_node(path: Sequence[str]) -> Optional[DictConfig]:
    """The schema's dict node at ``path`` (list of key parts), or None when it is not a dict node."""
    node = OmegaConf.select(schema(), ".".join(path))
    return node if isinstance(node, DictConfig) else None


def is_dict_field(key: str) -> bool:
    """True for a schema key whose value is a free-form dict (``data.chat_template_kwargs``), not a section."""
    node = schema_node(split_key(key))
    return node is not None and OmegaConf.get_type(node) is dict


def is_optional(key: str) -> bool:
    """True when the schema field ``key`` accepts null (unknown keys and keys inside dict fields: True)."""
    *parent, leaf = split_key(key)
    node = schema_node(parent)
    if node is None or OmegaConf.get_type(node) is dict or leaf not in node:
        return True
    return node._get_node(leaf)._is_optional()


def schema_keys(prefix: str = "") -> list[str]:
    """Keys of the schema directly under ``prefix`` (``""`` = top level, ``"actor.optim"``), in order.

    Raises:
        ConfigKeyError: ``prefix`` is not a section of the schema.
    """
    parts = [p for p in prefix.split(".") if p]
    node = schema_node(parts)
    if node is None:
        raise unknown_key_error(prefix, source="schema_keys()")
    return [str(k) for k in node.keys()]


@functools.lru_cache(maxsize=1)
def all_schema_paths() -> tuple[str, ...]:
    """Every full dotted key of the schema, sections and leaves."""
    out: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for k in node.keys():
            full = f"{prefix}{k}"
            out.append(full)
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                walk(child, full + ".")

    walk(schema(), "")
    return tuple(out)


def split_key(full_key: str) -> list[str]:
    """``"a.b[0].c"`` -> ``["a", "b", "c"]`` (list indices dropped)."""
    return [p for p in re.sub(r"\[[^\]]*\]", "", full_key).split(".") if p]


def first_bad_part(parts: Sequence[str]) -> Optional[int]:
    """Index of the first key part that is not in the schema (None when the whole path is valid or
    leaves the schema's dict nodes, e.g. goes inside a list or an ``Any`` field)."""
    node: Any = schema()
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is dict:  # a dict-valued field: any key
            return None
        if part not in node:
            return i
        node = node._get_node(part)
    return None


def nearest_keys(full_key: str, n: int = 3) -> list[str]:
    """Nearest valid full keys for an unknown ``full_key``: close names at the same level first
    (difflib), then keys elsewhere in the schema that end the same way (a key moved to another
    section, or verl's ``actor_rollout_ref.actor.clip_ratio`` for our ``actor.clip_ratio``)."""
    parts = split_key(full_key)
    i = first_bad_part(parts)
    if i is None:
        return []
    prefix, bad = parts[:i], parts[i]
    level = [str(k) for k in schema_node(prefix).keys()]  # type: ignore[union-attr]
    pre = ".".join(prefix) + "." if prefix else ""
    out = [pre + m for m in difflib.get_close_matches(bad, level, n=n, cutoff=0.6)]
    paths = all_schema_paths()
    tail = parts[i:]
    for k in range(len(tail), 0, -1):  # longest matching suffix first
        found = [p for p in paths if p.split(".")[-k:] == tail[-k:]]
        if found:
            out += found
            break
    if not out:  # a fuzzy leaf-name match anywhere
        leaf = {p.split(".")[-1]: [] for p in paths}
        for p in paths:
            leaf[p.split(".")[-1]].append(p)
        for m in difflib.get_close_matches(tail[-1], list(leaf), n=n, cutoff=0.75):
            out += leaf[m]
    seen: list[str] = []
    for p in out:
        if p not in seen:
            seen.append(p)
    return seen[:n]


def unknown_key_error(full_key: str, source: str = "") -> ConfigKeyError:
    """The error for a key that is not in the schema: the key, its ``source``, the section that lacks it,
    the nearest valid keys (:func:`nearest_keys`) and the section's valid keys, on at most three lines."""
    parts = split_key(full_key)
    i = first_bad_part(parts)
    if i is None:  # should not happen; keep a useful message anyway
        return ConfigKeyError(f"Unknown config key {full_key!r}" + (f" ({source})" if source else "") + ".",
                              key=full_key, source=source)
    prefix, bad = parts[:i], parts[i]
    where = f"section {'.'.join(prefix)!r}" if prefix else "the top level"
    level = [str(k) for k in schema_node(prefix).keys()]  # type: ignore[union-attr]
    suggestions = nearest_keys(full_key)
    lines = [f"Unknown config key {full_key!r}" + (f" ({source})" if source else "") + "."]
    lines.append(f"{where[0].upper()}{where[1:]} has no key {bad!r}."
                 + (f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""))
    lines.append((f"Valid keys in {'.'.join(prefix)!r}: " if prefix else "Valid top-level keys: ") + ", ".join(level))
    from rlhf.config.resume import RESUME_HINT, is_resume_option

    if is_resume_option(parts[-1]):  # trainer.ckpt_path, resume_from_checkpoint, load_dir, ...
        lines.append(RESUME_HINT[0].upper() + RESUME_HINT[1:] + ".")
    return ConfigKeyError("\n".join(lines), key=full_key, suggestions=suggestions, source=source)
