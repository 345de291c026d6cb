"""Keys of the structured schema, the nearest-key hints of an unknown key, and what Hydra / OmegaConf raise worded
as our short messages (the one place that reads their exceptions)."""
from __future__ import annotations

import difflib
import functools
import re
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf.config.errors import ConfigError, ConfigKeyError, ConfigValidationError


@functools.lru_cache(maxsize=1)
def schema() -> Any:
    """The schema with its defaults (:class:`~rlhf.config.schema.RLHFConfig`) as a DictConfig, built once."""
    from rlhf.config.schema import RLHFConfig

    return OmegaConf.structured(RLHFConfig)


def schema_node(path: Sequence[str]) -> Any:
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
    return node is None or OmegaConf.get_type(node) is dict or leaf not in node or node._get_node(leaf)._is_optional()


def schema_keys(prefix: str = "") -> list[str]:
    """Keys of the schema directly under ``prefix`` (``""`` = top level, ``"actor.optim"``), in order.  Raises
    ConfigKeyError: ``prefix`` is not a section of the schema."""
    node = schema_node([p for p in prefix.split(".") if p])
    if node is None:
        raise unknown_key_error(prefix, source="schema_keys()")
    return [str(k) for k in node.keys()]


@functools.lru_cache(maxsize=1)
def all_schema_paths() -> tuple[str, ...]:
    """Every full dotted key of the schema, sections and leaves."""
    def walk(node: Any, prefix: str) -> list[str]:
        return [p for k in node.keys() for p in [f"{prefix}{k}", *(walk(node._get_node(k), f"{prefix}{k}.") if
                                                                    isinstance(node._get_node(k), DictConfig) else [])]]

    return tuple(walk(schema(), ""))


def split_key(full_key: str) -> list[str]:
    """``"a.b[0].c"`` -> ``["a", "b", "c"]`` (list indices dropped)."""
    return [p for p in re.sub(r"\[[^\]]*\]", "", full_key).split(".") if p]


def first_bad_part(parts: Sequence[str]) -> Optional[int]:
    """Index of the first key part that is not in the schema (None when the whole path is valid or leaves the
    schema's dict nodes, e.g. goes inside a list or a dict-valued field)."""
    node: Any = schema()
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is dict:
            return None
        if part not in node:
            return i
        node = node._get_node(part)
    return None


def nearest_keys(full_key: str, n: int = 3) -> list[str]:
    """Nearest valid full keys for an unknown ``full_key``: close names at the same level first (difflib; with the
    rest of the key when that is valid under the close name), then
    keys elsewhere in the schema that end the same way (a key moved to another section, or verl's
    ``actor_rollout_ref.actor.clip_ratio`` for our ``actor.clip_ratio``), else a close leaf name anywhere."""
    parts = split_key(full_key)
    i = first_bad_part(parts)
    if i is None:
        return []
    pre = ".".join(parts[:i]) + "." if i else ""
    out = [pre + m for m in difflib.get_close_matches(parts[i], schema_keys(pre[:-1]), n=n, cutoff=0.6)]
    # a misspelt section with a valid rest (distillation.enable -> distill.enable): the whole key first
    out = [".".join([m, *parts[i + 1:]]) if first_bad_part(split_key(".".join([m, *parts[i + 1:]]))) is None else m
           for m in out]
    paths, tail = all_schema_paths(), parts[i:]
    out += next((found for k in range(len(tail), 0, -1)  # the longest matching suffix
                 if (found := [p for p in paths if p.split(".")[-k:] == tail[-k:]])), [])
    leaves = sorted({p.rsplit(".", 1)[-1] for p in paths})
    out = out or [p for m in difflib.get_close_matches(tail[-1], leaves, n=n, cutoff=0.75) for p in paths
                  if p.rsplit(".", 1)[-1] == m]
    return list(dict.fromkeys(out))[:n]


def unknown_key_error(full_key: str, source: str = "") -> ConfigKeyError:
    """The error for a key not in the schema: the key, its ``source``, the section that lacks it, the nearest
    valid keys (:func:`nearest_keys`) and the section's valid keys, on at most four lines."""
    from rlhf.resume import RESUME_HINT, is_resume_option

    parts = split_key(full_key)
    i = first_bad_part(parts)
    head = f"Unknown config key {full_key!r}" + (f" ({source})" if source else "") + "."
    if i is None:  # should not happen; keep a useful message anyway
        return ConfigKeyError(head, key=full_key, source=source)
    prefix, suggestions = ".".join(parts[:i]), nearest_keys(full_key)
    lines = [head, (f"Section {prefix!r}" if prefix else "The top level") + f" has no key {parts[i]!r}."
             + (f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""),
             (f"Valid keys in {prefix!r}: " if prefix else "Valid top-level keys: ") + ", ".join(schema_keys(prefix))]
    lines += [RESUME_HINT[0].upper() + RESUME_HINT[1:] + "."] * is_resume_option(parts[-1])  # trainer.ckpt_path, ...
    return ConfigKeyError("\n".join(lines), key=full_key, suggestions=suggestions, source=source)


def _chain(e: Optional[BaseException]) -> list[BaseException]:
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def omegaconf_error(e: BaseException, source: str = "", key: str = "") -> Optional[ConfigError]:
    """An unknown key (:class:`ConfigKeyError`, with the nearest keys), a bad value or interpolation
    (:class:`ConfigValidationError`) from what OmegaConf raised anywhere in ``e``'s chain, else None.  ``key``: the
    override applied (OmegaConf names only the first missing part of an unknown key)."""
    from omegaconf.errors import ConfigKeyError as OCKeyError, InterpolationResolutionError, ValidationError
    from omegaconf.nodes import EnumNode

    from rlhf.config.choices import choice_problem

    chain, at = _chain(e), f" ({source})" if source else ""
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
        if isinstance(c, ValidationError):
            node, parent = c.child_node, c.parent_node
            element = parent._metadata.element_type if isinstance(parent, ListConfig) else None
            if isinstance(node, EnumNode):
                return ConfigValidationError([choice_problem(full_key, c.value, node.enum_type, node._is_optional())
                                              + at])
            if isinstance(element, type) and hasattr(element, "__members__"):  # a list of choices
                return ConfigValidationError([choice_problem(full_key, c.value, element) + at])
            return ConfigValidationError([f"{full_key}: {str(c).splitlines()[0]}{at}"])
    bad = next((c for c in chain if key and isinstance(c, ValidationError)), None)
    return ConfigValidationError([f"{key}: {str(bad).splitlines()[0]}{at}"]) if bad is not None else None


def compose_error(e: BaseException, overrides: Sequence[str] = ()) -> ConfigError:
    """Any Hydra / OmegaConf error of composing with ``overrides`` as a short ConfigError: an unknown recipe or
    preset (close names and all names), :func:`omegaconf_error`'s messages with the file or override it came from,
    else Hydra's first line and the cause's."""
    from hydra.errors import MissingConfigException

    group, _, name = (getattr(e, "missing_cfg_file", None) or "").partition("/")
    if isinstance(e, MissingConfigException) and group in ("recipe", "algorithm"):
        what, avail = "recipe" if group == "recipe" else "algorithm preset", list(e.options or [])
        close = difflib.get_close_matches(name, avail, n=3, cutoff=0.5)
        return ConfigKeyError(f"Unknown {what} {name!r}." + (f" Did you mean: {', '.join(close)}?" if close else "")
                              + f"\nAvailable {what}s: {', '.join(avail) or '(none)'}", name, close, f"{group}=")
    text, source = str(e), ""
    if m := re.search(r"In '([^']+)'", text):
        source = f"in {m.group(1)}.yaml"
    elif (m := re.search(r"Error merging override (\S+)", text)) and m.group(1) in overrides:
        source = f"command-line override {m.group(1)!r}"
    elif m := re.search(r"Could not override '([^']+)'", text):
        source = next((f"command-line override {o!r}" for o in overrides
                       if o.split("=", 1)[0].lstrip("+~") == m.group(1)), "")
    found = omegaconf_error(e, source)
    if found is not None:
        return found
    chain, first = _chain(e), text.split("\nConfig search path:")[0]
    if len(chain) > 1:
        first += f"\n{type(chain[-1]).__name__}: {str(chain[-1]).splitlines()[0] if str(chain[-1]) else ''}"
    return ConfigError(first)
