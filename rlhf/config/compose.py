"""compose_config: the training config composed by Hydra's compose API from this package's tree, every problem
reported together (the Python API's way in; ``rlhf.main`` runs it before handing the overrides to ``@hydra.main``).
verl's keys are translated first (:func:`translate`), every override is applied to the schema by OmegaConf (unknown
keys, types, choices), then Hydra composes; any working directory, no torch."""
from __future__ import annotations

import copy
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf

from rlhf.config.choices import GROUP_ESTIMATORS
from rlhf.config.errors import ConfigError, ConfigKeyError, raise_all
from rlhf.config.keys import compose_error, omegaconf_error, schema
from rlhf.config.verl import compat

SCHEMA_NAME = "ppo_trainer_schema"  # the schema in Hydra's ConfigStore, first of ppo_trainer.yaml's defaults
BASE_CONFIG_NAME = "ppo_trainer"  # the primary config, rlhf/config/ppo_trainer.yaml
RECIPE_GROUP, ALGORITHM_GROUP = "recipe", "algorithm"  # recipe=NAME, algorithm=NAME
CONFIG_DIR = Path(__file__).resolve().parent
#: recipes/<name>/<name>.yaml beside their launch scripts, shared bases in recipes/_base/ (installed beside rlhf/)
RECIPES_DIR = CONFIG_DIR.parents[1] / "recipes"


def register_configs() -> None:
    """Register in Hydra's ConfigStore the schema (:data:`SCHEMA_NAME`) and the built-in recipes (group ``recipe``,
    ``# @package _global_`` files; ``defaults: [_base/X]`` finds ``recipes/_base/X.yaml``), and the resolver
    ``rlhf.rollout_n`` (4 responses per prompt for the group estimators, else 1).  Idempotent."""
    from hydra.core.config_store import ConfigStore

    from rlhf.config.schema import RLHFConfig

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:  # storing converts the dataclass again (~0.5 s)
        store.store(name=SCHEMA_NAME, node=RLHFConfig)
        for group, name, path in [(RECIPE_GROUP, n, p) for n, p in recipe_files().items()] + [
                (f"{RECIPE_GROUP}/_base", p.stem, p) for p in sorted((RECIPES_DIR / "_base").glob("*.yaml"))]:
            store.store(group=group, name=name, node=OmegaConf.load(path), package="_global_",
                        provider=str(path.relative_to(RECIPES_DIR.parent)))
    if not OmegaConf.has_resolver("rlhf.rollout_n"):
        OmegaConf.register_new_resolver("rlhf.rollout_n", lambda est: 4 if est in GROUP_ESTIMATORS else 1)


def recipe_files() -> dict[str, Path]:
    """``{name: recipes/<name>/<name>.yaml}`` of the built-in recipes."""
    return {d.name: d / f"{d.name}.yaml" for d in sorted(RECIPES_DIR.iterdir()) if not d.name.startswith("_")
            and (d / f"{d.name}.yaml").is_file()} if RECIPES_DIR.is_dir() else {}


def list_options(group: str, search_paths: Iterable[Union[str, os.PathLike]] = ()) -> list[str]:
    """The options of a config group, sorted: the built-in ones and ``<dir>/<group>/*.yaml`` of the extra
    directories ``search_paths`` (plain paths, ``file://`` or ``pkg://``)."""
    import importlib.util

    dirs = [CONFIG_DIR]
    for s in map(str, search_paths):
        spec = importlib.util.find_spec(s[6:]) if s.startswith("pkg://") else None
        dirs += [Path(p) for p in spec.submodule_search_locations or []] if spec else [Path(s.removeprefix("file://"))]
    names = set(recipe_files()) if group == RECIPE_GROUP else set()
    return sorted(names | {p.stem for d in dirs for ext in ("yaml", "yml") for p in (d / group).glob(f"*.{ext}")})


def list_recipes(search_paths: Iterable[Union[str, os.PathLike]] = ()) -> list[str]:
    """Names of the recipes (:func:`list_options`)."""
    return list_options(RECIPE_GROUP, search_paths)


def list_algorithms(search_paths: Iterable[Union[str, os.PathLike]] = ()) -> list[str]:
    """Names of the algorithm presets (:func:`list_options`)."""
    return list_options(ALGORITHM_GROUP, search_paths)


def translate(overrides: Sequence[str], config_file: Optional[Union[str, os.PathLike]] = None) -> compat.Translated:
    """The config file's settings (:mod:`rlhf.config.config_file`; the recipes registered first: it may name one),
    then ``overrides``, through the verl translation (:func:`rlhf.config.verl.compat.translate`).  Raises
    ConfigError: an unreadable config file."""
    from rlhf.config.config_file import load_config_file

    register_configs()
    return compat.translate(overrides, load_config_file(config_file) if config_file is not None else ())


def check_overrides(overrides: Sequence[str], sources: Optional[dict] = None) -> tuple[dict, list, list, list]:
    """Each override applied to a copy of the schema in struct mode, so OmegaConf checks its key, type and choices:
    (group choices ``{"recipe": [...], "algorithm": [...]}``, a line per bad value, the lines to leave out when
    composing, a ConfigKeyError per unknown key).  ``sources``: where a line came from (default the command line).
    Raises ConfigError: an override Hydra cannot parse, a package override (``key@pkg``), a deleted schema key."""
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        parsed = compat._parser().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"Cannot parse command-line override: {e}\nOverrides look like key=value, e.g. "
                          "trainer.total_training_steps=10 or data.train_files=[a.jsonl,b.jsonl].") from None
    choices, problems, skip, unknown = {RECIPE_GROUP: [], ALGORITHM_GROUP: []}, [], [], []
    trial = copy.deepcopy(schema())
    OmegaConf.set_struct(trial, True)
    for ov in parsed:
        key, where = ov.key_or_group, (sources or {}).get(ov.input_line) or f"command-line override {ov.input_line!r}"
        if ov.package is not None:
            raise ConfigError(f"{where}: package overrides (key@pkg) are not supported.")
        if key in choices and not ov.is_delete():  # group=null: no recipe / no preset, the default
            (choices[key].append(str(ov.value())) if ov.value() is not None else skip.append(ov.input_line))
        elif ov.is_delete():
            raise ConfigError(f"{where}: keys of the schema cannot be deleted; set a value instead (e.g. {key}=null "
                              f"where the key allows None).")
        elif key.split(".")[0] != "hydra":
            sweep = ov.value_type != ValueType.ELEMENT  # a sweep's values are checked per job, here its key
            try:
                OmegaConf.update(trial, key, None if sweep else ov.value(), merge=True)
            except Exception as e:  # noqa: BLE001 - what is not worded here, composing reports
                found = omegaconf_error(e, where, key)
                if isinstance(found, ConfigKeyError):
                    unknown.append(found)
                elif found is None or sweep:
                    continue
                else:
                    problems += found.problems
                skip.append(ov.input_line)
    return choices, problems, skip, unknown


def compose_config(overrides: Sequence[str] = (), recipe: Optional[str] = None, *,
                   search_paths: Sequence[Union[str, os.PathLike]] = (),
                   config_file: Optional[Union[str, os.PathLike]] = None, check_files: bool = False) -> DictConfig:
    """The training config (a DictConfig in struct mode typed by :class:`rlhf.config.schema.RLHFConfig`, ``${...}``
    resolved): schema defaults < ``ppo_trainer.yaml`` < recipe < algorithm preset < config file < ``overrides``.

    Args:
        overrides: Hydra overrides (``["trainer.total_training_steps=5", "algorithm=grpo"]``), verl's keys too.
        recipe: ``recipes/<name>/<name>.yaml`` (None: the overrides' ``recipe=``, else none).
        search_paths: extra config directories (plain paths, ``file://`` or ``pkg://``), e.g. with ``recipe/X.yaml``.
        config_file: a YAML file of settings, verl's layout or ours (:mod:`rlhf.config.config_file`).
        check_files: when the config has problems, name those of its files too (:func:`rlhf.config.validate.
            config_problems`), so one error holds them all; a config without problems is returned unchecked.

    Raises:
        ConfigKeyError: a key not in the schema, an unknown recipe or preset (the key, its source, the nearest valid
            keys; other problems in ``problems``).
        ConfigValidationError: bad values (types, choices, ranges, rules, unsupported verl settings), all of them.
        ConfigError: any other composition problem (malformed override, conflicting recipes).
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(overrides, str):
        raise TypeError("compose_config: overrides must be a list of 'key=value' strings, not one string")
    t = translate([str(o) for o in overrides], config_file)
    choices, problems, skip, unknown = check_overrides(t.overrides, t.origins)
    overrides = [o for o in t.overrides if o not in skip]  # bad values are reported below, with the rest
    if recipe is not None:
        if any(r != recipe for r in choices[RECIPE_GROUP]):
            raise ConfigError(f"compose_config: recipe={recipe!r} conflicts with override "
                              f"'recipe={choices[RECIPE_GROUP][-1]}'; give the recipe once.")
        overrides = overrides if choices[RECIPE_GROUP] else [f"{RECIPE_GROUP}={recipe}", *overrides]
    if search_paths:
        if any(o.split("=", 1)[0].lstrip("+") == "hydra.searchpath" for o in overrides):
            raise ConfigError("compose_config: give extra config directories either as search_paths or as a "
                              "hydra.searchpath override, not both.")
        uris = [s if re.match(r"^(file|pkg)://", s) else f"file://{Path(s).resolve()}" for s in map(str, search_paths)]
        overrides.append("hydra.searchpath=[" + ",".join(uris) + "]")
    register_configs()
    backup = get_gh_backup()
    GlobalHydra.instance().clear()  # e.g. called from a @hydra.main app: compose on our own, restore theirs
    try:
        with initialize_config_module(config_module="rlhf.config", version_base="1.3"):
            cfg = compose(config_name=BASE_CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise compose_error(e, overrides) from None
    finally:
        restore_gh_from_backup(backup)
    try:
        OmegaConf.to_container(cfg, resolve=True)  # a bad interpolation's error names the key that holds it
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise compose_error(e) from None
    verl_problems, notes = compat.after_compose(cfg, t)
    problems = t.problems + problems + verl_problems
    if problems or unknown or t.unknown:
        from rlhf.config.validate import config_problems
        from rlhf.config.verl.words import in_user_words

        words = lambda text: in_user_words(text, t)  # noqa: E731 - verl's keys where the user wrote them
        raise_all([ConfigKeyError(words(u.args[0]), key=u.key, suggestions=list(map(words, u.suggestions)),
                                  source=u.source) for u in t.unknown + unknown],
                  [words(p) for p in problems + config_problems(cfg, check_files=check_files)])
    from rlhf.launch_env import launch_env

    for line in notes if launch_env().rank == 0 else []:  # what a user should know (at --cfg and at start)
        logging.getLogger("rlhf.config").warning("rlhf.config: %s", line)
    return cfg

