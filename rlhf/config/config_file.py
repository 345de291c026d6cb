"""A whole config in one YAML file, verl's layout or ours: ``--config FILE``, or verl's ``--config-path DIR
--config-name NAME`` (``rlhf launch --config``, ``Trainer(config_file=...)``).

The file holds the keys it changes, nested or dotted; its ``defaults:`` list may name the base config
(``ppo_trainer`` / ``ppo_megatron_trainer``: verl's two bases are both ours), ``recipe: NAME``, ``algorithm: NAME``
and other files of its directory; ``hydra.run.dir`` in it works as on the command line.  A file whose ``defaults:``
name config groups of its own directory (verl's ``verl/trainer/config``) is composed by Hydra first, as verl would.
Its settings come before the command line's and go through the verl alias layer (:mod:`rlhf.config.verl.compat`);
``${...}`` interpolations are kept with verl's keys rewritten, and resolved within the file where they name a key
that has no equivalent here.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional, Union

from rlhf.config.errors import ConfigError
from rlhf.config.keys import is_dict_field, is_optional, schema_node
from rlhf.config.verl.compat import Item, translate_key

__all__ = ["BASE_NAMES", "find_config_file", "load_config_file"]

#: names a ``defaults:`` list or ``--config-name`` may use for the base config (ours and verl's)
BASE_NAMES = ("ppo_trainer", "ppo_megatron_trainer")
_REFS = re.compile(r"(?<=[{:,\s])([A-Za-z_]\w*(?:\.\w+)+)(?=\s*[},])")


def find_config_file(config_path: Optional[str], config_name: str, module_dir: Optional[Path] = None) -> Optional[Path]:
    """The file ``--config-path``/``--config-name`` name, or None for a base name (our own config).  ``config_path``
    is tried relative to the working directory, then (as Hydra does) to ``module_dir`` (rlhf/), so verl's
    ``--config-path=./config --config-name=ppo_megatron_trainer`` means our base config.

    Raises:
        ConfigError: no such file.
    """
    name = config_name.removesuffix(".yaml")
    dirs = [Path(config_path or ".")] + ([module_dir / config_path] if config_path and module_dir and not
                                         os.path.isabs(config_path) else [])
    for p in (d / f"{name}{ext}" for d in dirs for ext in (".yaml", ".yml")):
        if p.is_file() and (p.resolve().parent != Path(__file__).resolve().parent or name not in BASE_NAMES):
            return p
    if name in BASE_NAMES:
        return None
    raise ConfigError(f"--config-name={config_name}: no such config file (looked for "
                      f"{', '.join(str(d / f'{name}.yaml') for d in dirs)}); give --config-path=<directory of the "
                      f"file> or --config=<file>.")


def _dict_leaf(key: str) -> bool:
    """A key whose value is a dict as a whole (``data.chat_template_kwargs``), not a section."""
    ours = translate_key(key)
    return ours is not None and (schema_node(ours.split(".")) is None or is_dict_field(ours))


def _flatten(conf: Any, node: Any, prefix: str, source: str, out: list[Item]) -> None:
    """The settings under ``node`` as items: dict leaves whole, ``${...}`` values that name keys we cannot map
    resolved within the file (a dict they resolve to split into its keys); verl's "must be given" ``???`` and a null
    for a field of ours that takes no null (verl's "not set") leave our value in place."""
    from omegaconf import DictConfig, OmegaConf

    for k in node.keys():
        key, child = f"{prefix}{k}", node._get_node(k)
        if isinstance(child, DictConfig) and len(child) and not _dict_leaf(key):
            _flatten(conf, child, key + ".", source, out)
            continue
        value = OmegaConf.to_container(child, resolve=False) if OmegaConf.is_config(child) else child._value()
        if isinstance(value, str) and "${" in value and ("${." in value or ":." in value or not all(
                translate_key(r) for r in _REFS.findall(value))):
            try:
                got = OmegaConf.select(conf, key, throw_on_resolution_failure=True)
                value = OmegaConf.to_container(got, resolve=True) if OmegaConf.is_config(got) else got
            except Exception:  # noqa: BLE001 - left to composing, which names the key
                pass
        if isinstance(value, dict) and value and not _dict_leaf(key):
            _flatten(conf, OmegaConf.create(value), key + ".", source, out)
        elif value != "???" and not (value is None and translate_key(key) and not is_optional(translate_key(key))):
            out.append(Item(key, value, source=source))


def _compose_groups(path: Path) -> Any:
    """``path`` composed by Hydra with its directory as the config tree (its group defaults followed, as the program
    it was written for would), unresolved; our own Hydra state is left as it was.

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


def _group_file(entry: Any, directory: Path) -> Optional[Path]:
    """The file a defaults entry with a package or group names (``{actor@actor_rollout_ref.actor: dp_actor}`` ->
    ``actor/dp_actor.yaml``), None for a plain file entry and for our ``recipe:`` / ``algorithm:`` entries."""
    if isinstance(entry, dict) and len(entry) == 1:
        (key, name), = entry.items()
        group = str(key).split("@")[0].lstrip("+").removeprefix("override ").strip()
        return None if group in ("recipe", "algorithm") or name is None else directory / group / f"{name}.yaml"
    return directory / f"{entry.split('@')[0]}.yaml" if isinstance(entry, str) and "@" in entry else None


def load_config_file(path: Union[str, os.PathLike], _seen: Optional[set] = None) -> tuple[list[Item], list[str]]:
    """Read ``path`` into items (lowest precedence first) and problems (``defaults:`` entries we cannot follow).

    Raises:
        ConfigError: the file cannot be read, is not a YAML mapping, or includes itself.
    """
    from omegaconf import DictConfig, OmegaConf

    path, seen = Path(path), _seen if _seen is not None else set()
    if path.resolve() in seen:
        raise ConfigError(f"{path}: defaults: includes itself")
    seen.add(path.resolve())
    try:
        conf = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - yaml / IO errors
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if not isinstance(conf, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(conf).__name__}")
    source, before, after, problems = f"config file {path}", [], [], []
    entries = OmegaConf.to_container(conf.defaults, resolve=False) if conf.get("defaults") else []
    if any(f is not None and f.is_file() for f in (_group_file(e, path.parent) for e in entries)):
        conf = _compose_groups(path)  # verl's own config tree: Hydra composes it, its settings then go through
        entries = []
    conf.pop("defaults", None)
    target = before
    for entry in entries:
        name = entry.split("@")[0].removesuffix(".yaml") if isinstance(entry, str) else None
        if entry == "_self_":
            target = after
        elif name in BASE_NAMES:
            continue
        elif name is not None and (path.parent / f"{name}.yaml").is_file():
            sub_items, sub_problems = load_config_file(path.parent / f"{name}.yaml", seen)
            target.extend(sub_items)
            problems += sub_problems
        elif isinstance(entry, dict) and len(entry) == 1 and next(iter(entry)) in ("recipe", "algorithm"):
            (group, choice), = entry.items()
            target.append(Item(group, choice, str(choice), source=source))
        else:
            problems.append(f"defaults entry {entry!r} in {path}: verl's config groups are built into rlhf's schema; "
                            f"drop the entry (keep ppo_trainer / ppo_megatron_trainer, recipe: NAME, algorithm: NAME "
                            f"or another file of {path.parent}).")
    hydra = conf.pop("hydra", None)
    run_dir = OmegaConf.select(hydra, "run.dir", throw_on_resolution_failure=False) if hydra is not None else None
    own = [Item("hydra.run.dir", run_dir, None, source=source)] if run_dir else []
    _flatten(conf, conf, "", source, own)
    return before + own + after, problems
