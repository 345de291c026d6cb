"""PPO-family algorithm functions (pure torch), verl ``core_algos`` API.

Layout, by idea:

* ``registry``: every name list (estimators, policy-loss modes, aggregation modes, KL types)
  and the verl registries / ``get_*_fn`` lookups; torch-free;
* ``estimators/``: advantage estimators, one module per family (gae, grpo: GRPO / Dr.GRPO /
  pass@k, rloo, reinforce: REINFORCE++ and its baseline variant, remax, opo, gpg);
* ``policy_losses/``: registered policy losses (ppo: vanilla dual-clip PPO and SAPO,
  sequence_level: GSPO and GMPO, policy_gradient: GPG and CISPO, covariance: Clip-Cov / KL-Cov);
* ``aggregation`` (agg_loss, micro-batch invariant counts), ``masked_ops``, ``kl`` (KL
  estimators, controllers, in-reward penalty), ``value_loss``, ``entropy``, ``dapo`` (overlong
  shaping, dynamic-sampling filter), ``dpo``, ``grouping``, ``config_access``;
* ``core_algos``: the verl-compatible facade re-exporting all of it.

The names are loaded on first use (PEP 562), so ``import rlhf.algorithms.registry`` (config
validation) imports no torch.  The registry names read the live registries, see registry.py.
"""

import pkgutil

from rlhf.algorithms import registry as _registry

#: this package's modules: a from-import of one of them must import it, never load the facade
_SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__))
_DPO_NAMES = ("DPO_LOSS_TYPES", "compute_dpo_loss")


def _public_names() -> list:
    from rlhf.algorithms import core_algos

    return [*core_algos.__all__, *_DPO_NAMES]


def __getattr__(name: str):
    if name == "__all__":
        return _public_names()
    if name in _registry.REGISTRY_NAMES:
        _registry.load_builtins()
        return getattr(_registry, name)
    if name.startswith("_") or name in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _DPO_NAMES:
        from rlhf.algorithms import dpo

        return getattr(dpo, name)
    from rlhf.algorithms import core_algos

    if name not in core_algos.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(core_algos, name)


def __dir__() -> list:
    return sorted(set(globals()) | set(_public_names()))
