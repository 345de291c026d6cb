"""Training configuration: a Hydra config tree checked by a structured schema.

    schema/            dataclasses: every key, its type (Enums for choices), its default and its range checks
    choices.py         the Enums and the torch-free name lists
    ppo_trainer.yaml   base config: defaults = [schema, _self_, recipe: null, algorithm: null], Hydra's settings
    algorithm/*.yaml   algorithm presets (``# @package _global_``), picked by ``algorithm=NAME``
    ../../recipes/     recipes/<NAME>/<NAME>.yaml beside the recipe's launch scripts (``recipe=NAME``)
    compose.py         compose_config: verl translation, then Hydra's compose API, all problems reported together
    verl/              verl's keys and what each means here (keys.yaml), applied by compat.py; config_file.py:
                       --config FILE / --config-path + --config-name (verl's layout or ours)
    errors.py          ConfigError and its subclasses, the nearest-key hints, Hydra/OmegaConf errors as our messages
    validate.py        validate_config: the rules across sections and (check_files) paths and the surroundings
                       (preflight.py, resume.py, refs.py: what a data / model reference points at)
    overrides.py       Python values as override strings; objects.py: in-process objects (object://...)

``python -m rlhf.main`` is the ``@hydra.main`` app on this tree (rlhf/main.py); it checks with the functions below
before Hydra runs the job.  Use::

    from rlhf.config import compose_config, validate_config
    cfg = compose_config(["algorithm=grpo", "trainer.total_training_steps=5"], recipe="quickstart")
    validate_config(cfg, world_size=1, check_files=True)

A misspelled or removed key raises :class:`ConfigKeyError` naming the key and its nearest valid keys; a wrong value
raises :class:`ConfigValidationError`; both subclass :class:`ConfigError` (a ValueError).
"""
from rlhf.config.compose import (ALGORITHM_GROUP, BASE_CONFIG_NAME, RECIPE_GROUP, SCHEMA_NAME, compose_config,
                                 list_algorithms, list_recipes, register_configs)
from rlhf.config.errors import ConfigError, ConfigKeyError, ConfigValidationError
from rlhf.config.keys import nearest_keys, schema_keys
from rlhf.config.validate import validate_config

__all__ = ["SCHEMA_NAME", "BASE_CONFIG_NAME", "RECIPE_GROUP", "ALGORITHM_GROUP", "register_configs", "ConfigError",
           "ConfigKeyError", "ConfigValidationError", "compose_config", "list_recipes", "list_algorithms",
           "nearest_keys", "schema_keys", "validate_config"]
