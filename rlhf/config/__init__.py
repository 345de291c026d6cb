"""Training configuration: the Hydra tree (ppo_trainer.yaml, algorithm/*.yaml presets, recipes/<NAME>/<NAME>.yaml)
composed onto the schema (schema/: types, defaults, rules.yaml) by compose.py after verl's keys are translated
(verl/keys.yaml); validate.py checks the rules across sections, and the run's files (rlhf/preflight.py).

    cfg = compose_config(["algorithm=grpo", "trainer.total_training_steps=5"], recipe="quickstart")
    validate_config(cfg, world_size=1, check_files=True)

A misspelled or removed key raises :class:`ConfigKeyError` naming its nearest valid keys, a wrong value
:class:`ConfigValidationError`; both subclass :class:`ConfigError` (a ValueError).
"""
from rlhf.config.compose import compose_config, list_algorithms, list_recipes, register_configs
from rlhf.config.errors import ConfigError, ConfigKeyError, ConfigValidationError
from rlhf.config.keys import nearest_keys, schema_keys
from rlhf.config.validate import validate_config

__all__ = ["register_configs", "ConfigError", "ConfigKeyError", "ConfigValidationError", "compose_config",
           "list_recipes", "list_algorithms", "nearest_keys", "schema_keys", "validate_config"]
