"""Compose the training config with Hydra from the config tree inside this package.

    schema defaults (schema.py) < ppo_trainer.yaml < recipes/<NAME>/<NAME>.yaml < algorithm/<NAME>.yaml < key=value

The tree is read with Hydra's compose API from the ``rlhf.config`` package, so composing works from any
working directory, in tests and on every torchrun / Slurm rank.  Keys and values are checked against the
structured schema (:mod:`rlhf.config.schema`) in struct mode; errors come as :class:`ConfigError`
subclasses with the key, where it came from and the fix.  Composing imports neither torch nor megatron.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf

from rlhf.config.choices import GROUP_ESTIMATORS
from rlhf.config.config_file import load_config_file
from rlhf.config.errors import ConfigError, raise_all
from rlhf.config.overrides import check_overrides
from rlhf.config.verl.compat import (Translated, check_same, ignored_lines, items_from_overrides, translate_items,
                                     verl_engine_count)

__all__ = ["compose_config", "register_configs", "list_recipes", "list_algorithms", "list_options",
           "describe_options", "default_rollout_n", "SCHEMA_NAME", "BASE_CONFIG_NAME", "RECIPE_GROUP",
           "ALGORITHM_GROUP", "RECIPES_DIR", "recipe_files"]

#: Name of the structured schema node in Hydra's ConfigStore (first entry of ppo_trainer.yaml's defaults).
SCHEMA_NAME = "ppo_trainer_schema"
#: Name of the base (primary) config file, without ``.yaml``.
BASE_CONFIG_NAME = "ppo_trainer"
#: The config group holding the recipes (``recipe=NAME``).
RECIPE_GROUP = "recipe"
#: The config group holding the algorithm presets (``algorithm=NAME``), applied on top of the recipe.
ALGORITHM_GROUP = "algorithm"
CONFIG_DIR = Path(__file__).resolve().parent
#: The recipes: ``recipes/<name>/<name>.yaml`` beside their launch scripts, shared bases in ``recipes/_base/``
#: (the repository's top-level folder, installed beside the ``rlhf`` package).
RECIPES_DIR = CONFIG_DIR.parents[1] / "recipes"
_CONFIG_MODULE = "rlhf.config"
DEFAULT_GROUP_N = 4


def default_rollout_n(adv_estimator: str) -> int:
    """``rollout.n`` when neither a recipe nor an override sets it (ppo_trainer.yaml interpolates this as
    ``${rlhf.rollout_n:${algorithm.adv_estimator}}``): 4 for the estimators that compare the responses of
    a prompt (:data:`~rlhf.config.choices.GROUP_ESTIMATORS`), else 1."""
    return DEFAULT_GROUP_N if adv_estimator in GROUP_ESTIMATORS else 1


def register_configs() -> None:
    """Register the structured schema (:class:`~rlhf.config.schema.RLHFConfig`) in Hydra's ConfigStore
    under :data:`SCHEMA_NAME` and the ``rlhf.rollout_n`` resolver.  Idempotent; :func:`compose_config`
    calls it."""
    from hydra.core.config_store import ConfigStore

    from rlhf.config.schema import RLHFConfig

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:  # storing converts the dataclass again (~0.5 s)
        store.store(name=SCHEMA_NAME, node=RLHFConfig)
        _store_recipes(store)
    if not OmegaConf.has_resolver("rlhf.rollout_n"):
        OmegaConf.register_new_resolver("rlhf.rollout_n", default_rollout_n)


def recipe_files() -> dict[str, Path]:
    """``{name: recipes/<name>/<name>.yaml}`` of the built-in recipes."""
    if not RECIPES_DIR.is_dir():
        return {}
    return {d.name: d / f"{d.name}.yaml" for d in sorted(RECIPES_DIR.iterdir())
            if not d.name.startswith("_") and (d / f"{d.name}.yaml").is_file()}


def _store_recipes(store) -> None:
    """The built-in recipes and their bases as Hydra config-group options (``recipe=NAME``; a recipe's
    ``defaults: [_base/X]`` finds ``recipes/_base/X.yaml``), each file a ``# @package _global_`` config."""
    nodes = [(RECIPE_GROUP, name, path) for name, path in recipe_files().items()]
    nodes += [(f"{RECIPE_GROUP}/_base", p.stem, p) for p in sorted((RECIPES_DIR / "_base").glob("*.yaml"))]
    for group, name, path in nodes:
        store.store(group=group, name=name, node=OmegaConf.load(path), package="_global_",
                    provider=str(path.relative_to(RECIPES_DIR.parent)))


def _search_dirs(search_paths: Iterable[Union[str, os.PathLike]]) -> list[Path]:
    dirs = [CONFIG_DIR]
    for sp in search_paths:
        s = str(sp)
        if s.startswith("pkg://"):
            import importlib.util

            spec = importlib.util.find_spec(s[len("pkg://"):])
            if spec is not None and spec.submodule_search_locations:
                dirs += [Path(p) for p in spec.submodule_search_locations]
            continue
        dirs.append(Path(s[len("file://"):] if s.startswith("file://") else s))
    return dirs


def list_options(group: str, search_paths: Iterable[Union[str, os.PathLike]] = ()) -> list[str]:
    """Names of the options (``<group>/<name>.yaml``) of a config group, sorted (the recipes: the built-in ones
    in ``recipes/`` and those of the extra directories)."""
    names = set(recipe_files()) if group == RECIPE_GROUP else set()
    for d in _search_dirs(search_paths):
        for ext in ("yaml", "yml"):
            names.update(p.stem for p in (d / group).glob(f"*.{ext}"))
    return sorted(names)


def list_recipes(search_paths: Iterable[Union[str, os.PathLike]] = ()) -> list[str]:
    """Names of the recipes: the built-in ``recipes/<name>/<name>.yaml`` and ``recipe/<name>.yaml`` in the extra
    config directories ``search_paths`` (plain paths, ``file://`` or ``pkg://``), sorted."""
    return list_options(RECIPE_GROUP, search_paths)


def list_algorithms(search_paths: Iterable[Union[str, os.PathLike]] = ()) -> list[str]:
    """Names of the algorithm presets (``algorithm/<name>.yaml``), sorted; like :func:`list_recipes`."""
    return list_options(ALGORITHM_GROUP, search_paths)


def describe_options(group: str) -> list[tuple[str, str]]:
    """(name, first descriptive comment line) of each built-in option of ``group`` (for ``--help``)."""
    out = []
    for name in list_options(group):
        desc = ""
        path = recipe_files()[name] if group == RECIPE_GROUP else CONFIG_DIR / group / f"{name}.yaml"
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line.startswith("#") and "@package" not in line and line.lstrip("# "):
                desc = line.lstrip("# ")
                desc = desc.split(":", 1)[1].strip() if desc.startswith(f"{name}:") else desc
                break
        out.append((name, desc))
    return out


def compose_config(overrides: Sequence[str] = (), recipe: Optional[str] = None, *,
                   search_paths: Sequence[Union[str, os.PathLike]] = (), resolve: bool = True,
                   config_file: Optional[Union[str, os.PathLike]] = None, check_files: bool = False) -> DictConfig:
    """Compose the training config: schema defaults < ``ppo_trainer.yaml`` < recipe < algorithm preset <
    ``overrides``.

    Args:
        overrides: Hydra overrides, e.g. ``["trainer.total_training_steps=5", "data.train_files=x.jsonl"]``;
            may contain ``recipe=NAME`` instead of the ``recipe`` argument, and ``algorithm=NAME`` to apply
            the preset ``algorithm/<NAME>.yaml`` on top of the recipe.
        recipe: name of the recipe, ``recipes/<name>/<name>.yaml`` (None: the overrides' ``recipe=``, else no recipe).
        search_paths: extra config directories (plain paths, ``file://`` or ``pkg://``) searched after
            this package, e.g. one holding your own ``recipe/my_run.yaml``.
        resolve: resolve ``${...}`` interpolations in place (every rank then sees plain values).
        config_file: a YAML file of settings (verl's layout or ours, :mod:`rlhf.config.config_file`) applied
            before ``overrides``.
        check_files: when the config has problems, also name those of its data and model references (the
            model's architecture and parallel layout: :func:`rlhf.config.validate.config_problems`), so one
            error holds them all; a config without problems is returned unchecked (``validate_config`` then).

    verl's keys (``actor_rollout_ref.actor.optim.lr``, ``critic.model.path``, ...) are rewritten to ours by
    :mod:`rlhf.config.verl.compat`; ``hydra.run.dir=DIR`` sets ``trainer.default_local_dir`` unless that is
    given too.  Every problem (unknown keys, unsupported verl settings, bad values, rules across sections) is
    reported in one error.

    Returns:
        The composed DictConfig in struct mode (reading or setting an unknown key raises), typed by
        :class:`rlhf.config.schema.RLHFConfig`; ``OmegaConf.to_object(cfg)`` gives the dataclass.

    Raises:
        ConfigKeyError: a key not in the schema (override, config file or recipe file), an unknown recipe or
            algorithm preset; the message names the key, its source and the nearest valid keys (with other
            problems found at the same time in ``problems``).
        ConfigValidationError: values of the wrong type or not among a field's choices (every such
            override, together with :func:`rlhf.config.validate.config_problems` of the rest), or a bad
            interpolation.
        ConfigError: any other composition problem (malformed override, conflicting recipes).
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf.errors import OmegaConfBaseException

    from rlhf.config.hydra_errors import config_error

    if isinstance(overrides, str):
        raise TypeError("compose_config: overrides must be a list of 'key=value' strings, not one string")
    translated = _translate([str(o) for o in overrides], config_file)
    overrides = _run_dir(translated.overrides)
    checked = check_overrides(overrides, translated.origins)
    recipes = checked.choices[RECIPE_GROUP]
    if recipe is not None:
        if any(r != recipe for r in recipes):
            raise ConfigError(f"compose_config: recipe={recipe!r} conflicts with override "
                              f"'recipe={recipes[-1]}'; give the recipe once.")
        if not recipes:
            overrides = [f"{RECIPE_GROUP}={recipe}", *overrides]
    if search_paths:
        if any(o.split("=", 1)[0].lstrip("+") == "hydra.searchpath" for o in overrides):
            raise ConfigError("compose_config: give extra config directories either as search_paths or as a "
                              "hydra.searchpath override, not both.")
        uris = [s if re.match(r"^(file|pkg)://", s) else f"file://{Path(s).resolve()}" for s in map(str, search_paths)]
        overrides.append("hydra.searchpath=[" + ",".join(uris) + "]")
    overrides = [o[1:] if o.startswith(("+recipe=", "+algorithm=")) else o  # a group choice, not an addition
                 for o in overrides if o not in checked.skip]  # bad values are reported below, with the rest

    register_configs()
    backup = get_gh_backup()
    if GlobalHydra.instance().is_initialized():  # e.g. called from a @hydra.main app: compose on our own
        GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=_CONFIG_MODULE, version_base="1.3"):
            try:
                cfg = compose(config_name=BASE_CONFIG_NAME, overrides=overrides)
            except (HydraException, OmegaConfBaseException, ValueError) as e:
                raise config_error(e, overrides) from None
    finally:
        restore_gh_from_backup(backup)

    if resolve:
        try:
            OmegaConf.resolve(cfg)
        except OmegaConfBaseException as e:
            try:  # the same error again, this time naming the key that holds the interpolation
                OmegaConf.to_container(cfg, resolve=True)
            except OmegaConfBaseException as named:
                e = named
            raise config_error(e) from None
    engines = verl_engine_count(cfg, translated)
    if engines is not None:  # a verl config: one rollout replica per rollout TP group of the job's GPUs, as verl
        _set_verl_engine_count(cfg, engines)
    problems = translated.problems + checked.problems + check_same(cfg, translated.same)
    if problems or checked.unknown or translated.unknown:
        from rlhf.config.validate import config_problems

        raise_all(translated.unknown + checked.unknown, problems + config_problems(cfg, check_files=check_files))
    _tell(translated)
    return cfg


def _translate(overrides: list[str], config_file: Optional[Union[str, os.PathLike]]) -> Translated:
    """The config file's settings, then the overrides, in our keys (:mod:`rlhf.config.verl.compat`)."""
    items, problems = load_config_file(config_file) if config_file is not None else ([], [])
    cli_items, passthrough = items_from_overrides(overrides)
    translated = translate_items(items + cli_items)
    translated.overrides += passthrough
    translated.problems[:0] = problems
    return translated


def _run_dir(overrides: list[str]) -> list[str]:
    """``hydra.run.dir=DIR`` (the run's directory, as Hydra apps have it) also sets
    ``trainer.default_local_dir=DIR`` unless that is set too."""
    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+")

    run_dirs = [o.split("=", 1)[1] for o in overrides if key(o) == "hydra.run.dir"]
    if run_dirs and not any(key(o) == "trainer.default_local_dir" for o in overrides):
        return [*overrides, f"trainer.default_local_dir={run_dirs[-1]}"]
    return overrides


def _set_verl_engine_count(cfg: DictConfig, engines: int) -> None:
    """``rollout.num_engines`` = verl's replica count ``engines``, or the most engines below it that this job places
    (colocated engines span nodes only where the weight sync allows it: rlhf/rollout/placement.py), said once in
    a warning naming both counts and the override that chooses."""
    from rlhf.config.validate import placement_problems

    for n in range(engines, 0, -1):
        cfg.rollout.num_engines = n
        if not placement_problems(cfg):
            break
    else:
        cfg.rollout.num_engines = engines  # nothing places: the validation names the problem with verl's count
    if cfg.rollout.num_engines != engines:
        logging.getLogger("rlhf.config").warning(
            "rlhf.config: verl would run %d rollout replicas here; this job places %d colocated engine(s) of TP %d "
            "(set rollout.num_engines to choose, or rollout.mode=disaggregated)", engines, cfg.rollout.num_engines,
            cfg.rollout.tensor_model_parallel_size)


def _tell(translated: Translated) -> None:
    """Warn (rank 0) about what the alias layer did that a user should know: settings read differently, and
    every verl setting that has no effect here (:func:`~rlhf.config.verl.compat.ignored_lines`)."""
    from rlhf.launch_env import launch_env

    lines = translated.notes + ignored_lines(translated.ignored)
    if lines and launch_env().rank == 0:
        import logging

        for line in lines:
            logging.getLogger("rlhf.config").warning("rlhf.config: %s", line)
