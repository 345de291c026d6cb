"""The algorithm names and registries (verl ``core_algos`` API); imports no torch.

Every name list of the algorithms is defined here once: the advantage estimators
(:class:`AdvantageEstimator`, ``algorithm.adv_estimator``), the policy-loss modes
(:class:`PolicyLossMode`, ``actor.policy_loss.loss_mode``), the loss aggregation modes
(``LOSS_AGG_MODES``), the KL estimators (``KL_PENALTY_TYPES``) and the KL-controller types
(``KL_CTRL_TYPES``).  rlhf.config builds its choices from them, so composing a config stays
torch-free.  The built-in estimators and losses register themselves when their modules
(rlhf.algorithms.estimators, rlhf.algorithms.policy_losses) are imported; every function
here, and reading a registry through rlhf.algorithms or core_algos, imports them first, so a
lookup always sees the built-ins (this module's own names stay empty until then: config
validation reads the declared names without importing torch).

Registries, as verl's tests use them:

* the dicts are one object each; ``rlhf.algorithms.ADV_ESTIMATOR_REGISTRY``,
  ``rlhf.algorithms.core_algos.ADV_ESTIMATOR_REGISTRY`` and this module's name read the
  same dict, so mutating it (``.clear()``, ``[name] = fn``, ``.pop()``) works through any name;
* the functions read the registry bound in THIS module at call time, so rebinding
  ``registry.ADV_ESTIMATOR_REGISTRY = {...}`` takes effect;
* verl's tests rebind the name in the facade (``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``,
  then ``register_adv_est`` / ``get_adv_estimator_fn``).  The facades never bind the two names
  (they read them here through a module ``__getattr__``), so a name found in a facade's
  namespace was rebound there: the next registry call adopts it (binds it here and removes
  it from the facade), after which every name reads the new dict again.
"""

import difflib
import sys
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    import torch


class AdvantageEstimator(str, Enum):
    """Names accepted by :func:`get_adv_estimator_fn` (``algorithm.adv_estimator``)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"


#: estimators whose baseline is computed over the rollout.n responses of each prompt (they need rollout.n >= 2)
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_vectorized", "rloo_vectorized", "opo",
                    "gpg", "grpo_passk")


class PolicyLossMode(str, Enum):
    """The built-in policy losses of :func:`get_policy_loss_fn` (``actor.policy_loss.loss_mode``)."""

    VANILLA = "vanilla"
    GSPO = "gspo"
    SAPO = "sapo"
    GPG = "gpg"
    CLIP_COV = "clip_cov"
    KL_COV = "kl_cov"
    GEO_MEAN = "geo_mean"
    CISPO = "cispo"


#: ``loss_agg_mode`` values of rlhf.algorithms.agg_loss
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: ``kl_penalty`` names of rlhf.algorithms.kl_penalty -> the estimator each computes (Schulman's k1, k2, k3,
#: or abs); a "+" suffix on any name gives that value with k2's gradient (straight-through)
KL_PENALTY_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}

#: ``algorithm.kl_ctrl.type`` values of rlhf.algorithms.get_kl_controller
KL_CTRL_TYPES = ("fixed", "adaptive")

#: ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
#: -> (loss, metrics)``, verl's policy-loss calling convention.
PolicyLossFn = Callable[
    ["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor", str, Any, Optional["torch.Tensor"]],
    tuple["torch.Tensor", dict],
]

ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}

#: the modules that re-export the registries (read-through, never bound there)
FACADES = ("rlhf.algorithms", "rlhf.algorithms.core_algos")
#: the registry names the facades read through
REGISTRY_NAMES = ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY")


def adopt_facade_rebinding() -> None:
    """Bind here a registry that was rebound in a facade (see the module docstring).

    Raises:
        ValueError: two facades rebound the same registry to different dicts.
    """
    for name in REGISTRY_NAMES:
        rebound = {m: vars(sys.modules[m])[name] for m in FACADES
                   if m in sys.modules and name in vars(sys.modules[m])}
        if len({id(d) for d in rebound.values()}) > 1:
            raise ValueError(f"{name} was rebound to different dicts in {sorted(rebound)}; rebind it once, "
                             f"or in {__name__} itself")
        for m in rebound:
            del vars(sys.modules[m])[name]
        if rebound:
            globals()[name] = next(iter(rebound.values()))


_builtins_imported = False


def load_builtins() -> None:
    """Import the built-in estimators and policy losses once (they register themselves; the
    registrations they make while importing do not re-enter), then adopt a facade rebinding.
    Reading a registry through rlhf.algorithms or core_algos, and every function here, calls it."""
    global _builtins_imported
    if not _builtins_imported:
        _builtins_imported = True
        try:
            import rlhf.algorithms.estimators  # noqa: F401  (registration on import)
            import rlhf.algorithms.policy_losses  # noqa: F401
        except BaseException:
            _builtins_imported = False
            raise
    adopt_facade_rebinding()


def _name_of(name_or_enum: Union[str, Enum]) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def _unknown(kind: str, name: str, valid) -> ValueError:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown {kind} {name!r}{hint}; valid: {sorted(valid)}")


def adv_estimator_names() -> list[str]:
    """Sorted names ``algorithm.adv_estimator`` accepts: the built-ins and whatever is registered now.
    Torch-free (the built-ins are not imported), for config validation."""
    adopt_facade_rebinding()
    return sorted({e.value for e in AdvantageEstimator} | set(ADV_ESTIMATOR_REGISTRY))


def policy_loss_names() -> list[str]:
    """Sorted names ``actor.policy_loss.loss_mode`` accepts (built-ins and registered ones); torch-free.
    :func:`get_policy_loss_fn` also accepts them with "-" for "_"."""
    adopt_facade_rebinding()
    return sorted({m.value for m in PolicyLossMode} | set(POLICY_LOSS_REGISTRY))


def register_adv_est(name_or_enum: Union[str, Enum]) -> Callable:
    """Decorator registering an advantage estimator under a name (str or Enum value).

    Registering the same function twice is a no-op.

    Raises:
        ValueError: the name is already registered to a different function.
    """

    def decorator(fn: Callable) -> Callable:
        load_builtins()
        name = _name_of(name_or_enum)
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to {ADV_ESTIMATOR_REGISTRY[name]}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: Union[str, Enum]) -> Callable:
    """Return the estimator registered under ``name_or_enum`` (case-sensitive).

    Raises:
        ValueError: unknown name; the message names the nearest registered one and lists them all.
    """
    load_builtins()
    name = _name_of(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise _unknown("advantage estimator", name, ADV_ESTIMATOR_REGISTRY)
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: Union[str, Enum], override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (``actor.policy_loss.loss_mode``; str or Enum value).

    Registering the same function twice is a no-op; replacing a registered loss
    needs ``override=True`` (so a typo cannot silently shadow a built-in loss).

    Raises:
        ValueError: the name is taken by a different function and ``override`` is False.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        load_builtins()
        key = _name_of(name)
        if not override and POLICY_LOSS_REGISTRY.get(key, fn) is not fn:
            raise ValueError(
                f"policy loss {key!r} is already registered to {POLICY_LOSS_REGISTRY[key]}; "
                "pass override=True to replace it"
            )
        POLICY_LOSS_REGISTRY[key] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: Union[str, Enum]) -> PolicyLossFn:
    """Return the policy loss registered under ``name``; ``clip-cov`` finds ``clip_cov``.

    Raises:
        ValueError: unknown name; the message names the nearest registered one and lists them all.
    """
    load_builtins()
    name = _name_of(name)
    for candidate in (name, name.replace("-", "_")):
        if candidate in POLICY_LOSS_REGISTRY:
            return POLICY_LOSS_REGISTRY[candidate]
    raise _unknown("policy loss mode", name, POLICY_LOSS_REGISTRY)
