"""A whole config in one YAML file: ``python -m rlhf.main --config FILE`` or Hydra's
``--config-path DIR --config-name NAME``, in verl's layout or ours.

The file holds the keys it changes, nested (``actor_rollout_ref: {actor: {optim: {lr: 1e-6}}}``) or dotted; its
``defaults:`` list may name the base config (``ppo_trainer`` / ``ppo_megatron_trainer``: verl's two bases are
both ours), a ``recipe: NAME`` or ``algorithm: NAME``, and other files of the same directory; ``hydra.run.dir``
in it works as on the command line.  A file whose ``defaults:`` name config groups of its own directory
(verl's ``--config-path=<verl>/verl/trainer/config --config-name=ppo_trainer``) is composed by Hydra first, as
verl would.  Its settings come before the command line's (the command line wins) and go through the verl alias
layer (:mod:`rlhf.config.verl.compat`).  ``${...}`` interpolations between keys are kept,
with verl's keys rewritten to ours; one that cannot be (its target has no equivalent) is resolved within the file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

from rlhf.config.errors import ConfigError
from rlhf.config.verl.compat import Item, translate_key

__all__ = ["BASE_NAMES", "find_config_file", "load_config_file"]

#: names a ``defaults:`` list or ``--config-name`` may use for the base config (ours and verl's)
BASE_NAMES = ("ppo_trainer", "ppo_megatron_trainer")


def find_config_file(config_path: Optional[str], config_name: str, module_dir: Optional[Path] = None) -> Optional[Path]:
    """The file ``--config-path``/``--config-name`` name, or None for a base name (our own config).

    ``config_path`` is tried relative to the working directory, then (as Hydra does) to ``module_dir``
    (the directory of rlhf/main.py), so verl's ``--config-path=./config --config-name=ppo_megatron_trainer``
    means our base config.

    Raises:
        ConfigError: no such file.
    """
    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    dirs = [Path(config_path or ".")]
    if config_path and not os.path.isabs(config_path) and module_dir is not None:
        dirs.append(module_dir / config_path)
    for d in dirs:
        for ext in (".yaml", ".yml"):
            p = d / f"{name}{ext}"
            if p.is_file() and (p.resolve().parent != Path(__file__).resolve().parent or name not in BASE_NAMES):
                return p
    if name in BASE_NAMES:
        return None
    tried = ", ".join(str(d / f"{name}.yaml") for d in dirs)
    raise ConfigError(f"--config-name={config_name}: no such config file (looked for {tried}); give "
                      f"--config-path=<directory of the file> or --config=<file>.")


def _flatten(node: Any, prefix: str, out: list[tuple[str, Any]]) -> None:
    from omegaconf import DictConfig, OmegaConf

    for k in node.keys():
        key = f"{prefix}{k}"
        child = node._get_node(k)
        value = child._value() if not isinstance(child, DictConfig) else None
        if isinstance(child, DictConfig) and len(child) and not _dict_leaf(key):
            _flatten(child, key + ".", out)
        elif isinstance(child, DictConfig) or OmegaConf.is_list(child):
            out.append((key, OmegaConf.to_container(child, resolve=False)))
        else:
            out.append((key, value))


def _dict_leaf(key: str) -> bool:
    """A key whose value is a dict as a whole (``data.chat_template_kwargs``), not a section."""
    from rlhf.config.keys import is_dict_field, schema_node

    ours = translate_key(key)
    return ours is not None and (schema_node(ours.split(".")) is None or is_dict_field(ours))


def _resolved(conf: Any, key: str, value: Any) -> Any:
    """A ``${...}`` value resolved within the file when it names keys we cannot map; else as it is."""
    from omegaconf import OmegaConf

    if not (isinstance(value, str) and "${" in value):
        return value
    import re

    refs = re.findall(r"(?<=[{:,\s])([A-Za-z_]\w*(?:\.\w+)+)(?=\s*[},])", value)
    if "${." not in value and ":." not in value and all(translate_key(r) for r in refs):
        return value  # rewritten to our keys by the alias layer; resolved when composing
    try:
        got = OmegaConf.select(conf, key, throw_on_resolution_failure=True)
        return OmegaConf.to_container(got, resolve=True) if OmegaConf.is_config(got) else got  # split by _add
    except Exception:  # noqa: BLE001 - left to composing, which names the key
        return value


def load_config_file(path: Union[str, os.PathLike], _seen: Optional[set] = None) -> tuple[list[Item], list[str]]:
    """Read ``path`` into items (lowest precedence first) and problems (``defaults:`` entries we cannot
    follow).

    Raises:
        ConfigError: the file cannot be read or is not a YAML mapping.
    """
    from omegaconf import DictConfig, OmegaConf

    path = Path(path)
    seen = _seen if _seen is not None else set()
    if path.resolve() in seen:
        raise ConfigError(f"{path}: defaults: includes itself")
    seen.add(path.resolve())
    try:
        conf = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - yaml / IO errors
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if not isinstance(conf, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(conf).__name__}")
    source = f"config file {path}"
    before, after, problems = [], [], []
    if _has_groups(conf.get("defaults"), path.parent):
        conf = _compose_groups(path)  # verl's own config tree: Hydra composes it, its settings then go through
    defaults = conf.pop("defaults", None) or []
    target = before
    for entry in OmegaConf.to_container(defaults, resolve=False) if defaults else []:
        if entry == "_self_":
            target = after
        elif isinstance(entry, str) and entry.split("@")[0].removesuffix(".yaml") in BASE_NAMES:
            continue
        elif isinstance(entry, str) and (path.parent / f"{entry.removesuffix('.yaml')}.yaml").is_file():
            sub_items, sub_problems = load_config_file(path.parent / f"{entry.removesuffix('.yaml')}.yaml", seen)
            target.extend(sub_items)
            problems += sub_problems
        elif isinstance(entry, dict) and len(entry) == 1 and next(iter(entry)) in ("recipe", "algorithm"):
            (group, name), = entry.items()
            target.append(Item(group, name, str(name), source=source))
        else:
            problems.append(f"defaults entry {entry!r} in {path}: verl's config groups are built into rlhf's schema; "
                            f"drop the entry (keep ppo_trainer / ppo_megatron_trainer, recipe: NAME, algorithm: NAME "
                            f"or another file of {path.parent}).")
    hydra = conf.pop("hydra", None)
    own: list[Item] = []
    if hydra is not None:
        run_dir = OmegaConf.select(hydra, "run.dir", throw_on_resolution_failure=False)
        if run_dir:
            own.append(Item("hydra.run.dir", run_dir, None, source=source))
    flat: list[tuple[str, Any]] = []
    _flatten(conf, "", flat)
    for k, v in flat:
        _add(own, k, _resolved(conf, k, v), source)
    return before + own + after, problems


def _group_file(entry: Any, directory: Path) -> Optional[Path]:
    """The file a Hydra defaults entry with a package or group names (``{actor@actor_rollout_ref.actor:
    dp_actor}`` -> ``actor/dp_actor.yaml``, ``reward_manager@reward_manager`` -> ``reward_manager.yaml``), or
    None for a plain file entry and for our ``recipe:`` / ``algorithm:`` entries."""
    if isinstance(entry, dict) and len(entry) == 1:
        (key, name), = entry.items()
        group = str(key).split("@")[0].lstrip("+").removeprefix("override ").strip()
        return None if group in ("recipe", "algorithm") or name is None else directory / group / f"{name}.yaml"
    if isinstance(entry, str) and "@" in entry:
        return directory / f"{entry.split('@')[0]}.yaml"
    return None


def _has_groups(defaults: Any, directory: Path) -> bool:
    """True when ``defaults`` names config groups / packaged files of which one exists under ``directory`` (a
    verl config directory such as verl/trainer/config, read with --config-path/--config-name)."""
    from omegaconf import OmegaConf

    entries = OmegaConf.to_container(defaults, resolve=False) if defaults is not None else []
    files = [f for f in (_group_file(e, directory) for e in entries) if f is not None]
    return any(f.is_file() for f in files)


def _compose_groups(path: Path) -> Any:
    """``path`` composed by Hydra with its directory as the config tree (its group defaults followed, as the
    program it was written for would), unresolved; our own Hydra state is left as it was.

    Raises:
        ConfigError: Hydra cannot compose the file.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf import OmegaConf

    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
            conf = compose(config_name=path.stem)
    except Exception as e:  # noqa: BLE001 - Hydra / OmegaConf composition errors
        raise ConfigError(f"cannot compose {path} with its config groups ({path.parent}): {e}") from None
    finally:
        restore_gh_from_backup(backup)
    OmegaConf.set_struct(conf, False)
    conf.pop("hydra", None)  # Hydra's own runtime node, not the file's hydra.run.dir
    return conf


def _add(items: list[Item], key: str, value: Any, source: str) -> None:
    """One file setting as items: a dict that an interpolation resolved to is split into its keys; verl's
    "must be given" ``???`` and a null for a field of ours that takes no null (verl's "not set") leave our
    value in place."""
    from rlhf.config.keys import is_optional

    if isinstance(value, dict) and value and not _dict_leaf(key):
        for k, v in value.items():
            _add(items, f"{key}.{k}", v, source)
        return
    if value == "???":
        return
    ours = translate_key(key)
    if value is None and ours is not None and not is_optional(ours):
        return
    items.append(Item(key, value, None, source=source))
