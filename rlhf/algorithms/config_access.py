"""Read algorithm settings from any config object (verl calling convention).

verl passes its ``AlgoConfig`` / ``ActorConfig`` dataclasses (or an OmegaConf
``DictConfig``) as ``config=`` to estimators and policy losses.  The functions
here read a field from any of those, from a plain ``dict``, or from ``None``
(then every field takes its default), so the algorithm functions work with
our Hydra config, verl's dataclasses and hand-written dicts in tests alike.
"""

from collections.abc import Mapping
from typing import Any

_MISSING = object()


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """Value of ``key`` in ``config``, or ``default`` when absent or None.

    Args:
        config: None, a Mapping (dict, DictConfig) or any object with attributes
            (dataclass, SimpleNamespace).
        key: field name; dots walk nested configs (``"policy_loss.clip_cov_ratio"``).
        default: returned when a part of the path is missing or the value is None.

    Example: ``config_get({"policy_loss": {"kl_cov_ratio": 0.01}}, "policy_loss.kl_cov_ratio")`` is 0.01.
    """
    node = config
    for part in key.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping):
            node = node.get(part, _MISSING)
        else:
            node = getattr(node, part, _MISSING)
        if node is _MISSING:
            return default
    return default if node is None else node


def resolve(explicit: Any, config: Any, key: str, default: Any = None) -> Any:
    """An explicit (non-None) keyword argument wins, then ``config``'s field, then ``default``."""
    return explicit if explicit is not None else config_get(config, key, default)


class ConfigOverlay:
    """A read-only view of ``base`` with some fields replaced, e.g. the actor config plus the
    ``global_batch_info`` a policy loss needs for micro-batch-invariant aggregation::

        cfg = ConfigOverlay(cfg.actor, global_batch_info=global_batch_info(mask, dp_size))
        loss, metrics = get_policy_loss_fn(mode)(old, new, adv, mask, cfg.loss_agg_mode, cfg)

    Attribute access and ``.get(key, default)`` look in the overrides first, then in ``base``.
    """

    def __init__(self, base: Any, **overrides: Any):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        value = config_get(object.__getattribute__(self, "_base"), name, _MISSING)
        if value is _MISSING:
            raise AttributeError(name)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        """Mapping-style access, as verl code calls ``config.get("clip_ratio_c", 3.0)``."""
        overrides = object.__getattribute__(self, "_overrides")
        if key in overrides:
            return overrides[key]
        return config_get(object.__getattribute__(self, "_base"), key, default)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ConfigOverlay is read-only; pass overrides to its constructor")
