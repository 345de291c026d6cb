"""Training configuration: a Hydra config tree checked by a structured schema.

Layout (all inside this package, so composition works from any working directory)::

    schema/              dataclasses: every key, its type (Enums for choices), its default and its range
    choices.py           the Enums and the torch-free name lists; errors.py: ConfigError and its subclasses
    compose.py           compose_config: Hydra compose of the tree below + recipe + algorithm preset + config
                         file + overrides
    verl/                verl's keys and what each means here (keys.py); compat.py applies them (the alias layer)
    config_file.py       --config FILE / --config-path + --config-name (verl's layout or ours)
    keys.py              schema keys and the "did you mean" error for an unknown key
    overrides.py         override strings checked by OmegaConf against the schema; Python values -> overrides
    hydra_errors.py      what Hydra / OmegaConf raise, as our short messages (the one place that reads them)
    validate.py          validate_config: rules across sections and (check_files) paths, all problems together
    refs.py              what a data / model reference points at (local, hub, embedded://, tiny://)
    objects.py           in-process objects (object://...) handed to rlhf.Trainer
    ppo_trainer.yaml     base config: defaults = [schema, _self_, recipe: null, algorithm: null]
    ../../recipes/       recipes: recipes/<NAME>/<NAME>.yaml (``# @package _global_``) beside the recipe's launch
                         scripts, picked by ``recipe=NAME``; shared bases in recipes/_base/
    algorithm/*.yaml     algorithm presets (``# @package _global_``), picked by ``algorithm=NAME``

Use::

    from rlhf.config import compose_config, validate_config
    cfg = compose_config(["algorithm=grpo", "trainer.total_training_steps=5"], recipe="quickstart")
    validate_config(cfg, world_size=1, check_files=True)

A misspelled or removed key raises :class:`ConfigKeyError` naming the key and its nearest valid keys;
a wrong value raises :class:`ConfigValidationError`; both subclass :class:`ConfigError` (a ValueError).
"""
from rlhf.config.compose import (ALGORITHM_GROUP, BASE_CONFIG_NAME, RECIPE_GROUP, SCHEMA_NAME, compose_config,
                                 list_algorithms, list_recipes, register_configs)
from rlhf.config.errors import ConfigError, ConfigKeyError, ConfigValidationError
from rlhf.config.keys import nearest_keys, schema_keys
from rlhf.config.validate import validate_config

__all__ = [
    "SCHEMA_NAME",
    "BASE_CONFIG_NAME",
    "RECIPE_GROUP",
    "ALGORITHM_GROUP",
    "register_configs",
    "ConfigError",
    "ConfigKeyError",
    "ConfigValidationError",
    "compose_config",
    "list_recipes",
    "list_algorithms",
    "nearest_keys",
    "schema_keys",
    "validate_config",
]
