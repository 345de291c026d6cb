"""Training configuration: Hydra config tree validated by a structured schema.

Layout (all inside this package, so composition works from any working directory)::

    rlhf/config/schema.py          dataclasses: every key, its type and default (RLHFConfig)
    rlhf/config/ppo_trainer.yaml   base config: defaults = [schema, _self_, recipe: null]
    rlhf/config/recipe/*.yaml      recipes (``# @package _global_`` overrides), picked by ``recipe=NAME``

Use::

    from rlhf.config import compose_config, validate_config
    cfg = compose_config(["trainer.total_training_steps=5"], recipe="quickstart")
    validate_config(cfg)

A misspelled or removed key raises :class:`ConfigKeyError` naming the key and its nearest valid keys;
a wrong value raises :class:`ConfigValidationError`; both subclass :class:`ConfigError` (a ValueError).
"""
from __future__ import annotations

#: Name of the structured schema node in Hydra's ConfigStore (first entry of ppo_trainer.yaml's defaults).
SCHEMA_NAME = "ppo_trainer_schema"
#: Name of the base (primary) config file, without ``.yaml``.
BASE_CONFIG_NAME = "ppo_trainer"
#: The config group holding the recipes.
RECIPE_GROUP = "recipe"


def register_configs() -> None:
    """Register the structured schema (:class:`~rlhf.config.schema.RLHFConfig`) in Hydra's ConfigStore
    under :data:`SCHEMA_NAME`, so ``ppo_trainer.yaml`` can list it in its defaults.

    Idempotent; :func:`~rlhf.config.loader.compose_config` calls it, so callers rarely need to.
    """
    from hydra.core.config_store import ConfigStore

    from rlhf.config.schema import RLHFConfig

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLHFConfig)


from rlhf.config.loader import (  # noqa: E402  (loader imports the names defined above)
    ConfigError,
    ConfigKeyError,
    ConfigValidationError,
    compose_config,
    list_recipes,
    schema_keys,
    validate_config,
)

__all__ = [
    "SCHEMA_NAME",
    "BASE_CONFIG_NAME",
    "RECIPE_GROUP",
    "register_configs",
    "ConfigError",
    "ConfigKeyError",
    "ConfigValidationError",
    "compose_config",
    "list_recipes",
    "schema_keys",
    "validate_config",
]
