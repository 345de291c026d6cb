"""A whole config in one YAML file, verl's layout or ours (``--config FILE``, verl's ``--config-path DIR --config-name
NAME``, ``Trainer(config_file=...)``).  Hydra composes it with its directory as the config tree, so its ``defaults:``
work as for the program it was written for (verl's groups; ``ppo_trainer`` / ``ppo_megatron_trainer``: verl's
defaults, rlhf/config/verl/; ``recipe:`` / ``algorithm:`` are ours); its settings, before the command line's, then go
through the verl translation (``${...}`` kept with verl's keys rewritten, or resolved where they have no equivalent)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from rlhf.config.errors import ConfigError
from rlhf.config.keys import is_dict_field, is_optional, schema_node
from rlhf.config.objects import format_value
from rlhf.config.verl.compat import INTERP_KEYS, Item, key_table, translate_key

#: rlhf/config/verl: verl's defaults for its base names, in verl's keys (ppo_trainer.yaml, ppo_megatron_trainer.yaml)
VERL_DEFAULTS = Path(__file__).resolve().parent / "verl"


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
                translate_key(r) for r in INTERP_KEYS.findall(value))):
            try:
                got = OmegaConf.select(conf, key, throw_on_resolution_failure=True)
                value = OmegaConf.to_container(got, resolve=True) if OmegaConf.is_config(got) else got
            except Exception:  # noqa: BLE001 - left to composing, which names the key
                pass
        if isinstance(value, dict) and value and not _dict_leaf(key):
            _flatten(conf, OmegaConf.create(value), key + ".", source, out)
        elif value != "???" and not (value is None and translate_key(key) and not is_optional(translate_key(key))):
            out.append(Item(key, value, source=source))


def load_config_file(path: Union[str, os.PathLike]) -> list[Item]:
    """The settings of the YAML file ``path`` as items, lowest precedence first (the recipes registered: a file may
    name one).  Raises ConfigError: Hydra cannot compose the file."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf import OmegaConf

    path, backup, source = Path(path), get_gh_backup(), f"config file {path}"
    GlobalHydra.instance().clear()
    try:
        raw = OmegaConf.load(path)
        # the file's recipe / preset are our group choices (under the command line's keys), not its settings
        entries = OmegaConf.to_container(raw, resolve=False).get("defaults") or [] if OmegaConf.is_dict(raw) else []
        groups = [(g, str(n)) for e in entries if isinstance(e, dict) for g, n in e.items() if g in ("recipe",
                                                                                                   "algorithm")]
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
            # rlhf/config/verl holds verl's defaults for ppo_trainer / ppo_megatron_trainer, rlhf/config the presets
            conf = compose(config_name=path.stem, overrides=["hydra.searchpath=[pkg://rlhf.config.verl,"
                                                             "pkg://rlhf.config]", *(f"~{g}" for g, _ in groups)])
    except Exception as e:  # noqa: BLE001 - Hydra / OmegaConf / YAML errors
        raise ConfigError(f"cannot read config file {path}: {str(e).splitlines()[0]}") from None
    finally:
        restore_gh_from_backup(backup)
    OmegaConf.set_struct(conf, False)
    run_dir = OmegaConf.select(raw, "hydra.run.dir", throw_on_resolution_failure=False)
    items = [Item(g, n, n, source=source) for g, n in groups]
    # verl picks a trainer by the entry point that loads a config of this name (keys.yaml config_names)
    items += [Item(k, v, format_value(v), source=source) for k, v in key_table()[4].get(path.stem, {}).items()]
    items += [Item("hydra.run.dir", run_dir, None, source=source)] if run_dir else []
    _flatten(conf, conf, "", source, items)
    return items
