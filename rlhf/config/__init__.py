"""Training configuration: a Hydra config tree checked by a structured schema.

    schema/            dataclasses: every key, its type (Enums of choices.py) and default; rules.yaml: ranges, rules
    ppo_trainer.yaml   base config and Hydra's settings; algorithm/*.yaml: presets (``algorithm=NAME``);
                       ../../recipes/<NAME>/<NAME>.yaml: recipes (``recipe=NAME``)
    compose.py         compose_config: verl translation (verl/: keys.yaml applied by compat.py; config_file.py:
                       --config FILE), then Hydra's compose API; all problems reported together (errors.py, keys.py)
    validate.py        validate_config: the rules across sections, and the run's surroundings (rlhf/preflight.py)
    objects.py         Python values as overrides, in-process objects (object://...), the run's config.yaml

    cfg = compose_config(["algorithm=grpo", "trainer.total_training_steps=5"], recipe="quickstart")
    validate_config(cfg, world_size=1, check_files=True)

A misspelled or removed key raises :class:`ConfigKeyError` naming the key and its nearest valid keys; a wrong value
raises :class:`ConfigValidationError`; both subclass :class:`ConfigError` (a ValueError).
"""
from rlhf.config.compose import compose_config, list_algorithms, list_recipes, register_configs
from rlhf.config.errors import ConfigError, ConfigKeyError, ConfigValidationError
from rlhf.config.keys import nearest_keys, schema_keys
from rlhf.config.validate import validate_config

__all__ = ["register_configs", "ConfigError", "ConfigKeyError", "ConfigValidationError", "compose_config",
           "list_recipes", "list_algorithms", "nearest_keys", "schema_keys", "validate_config"]
