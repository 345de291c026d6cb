"""The algorithm names and registries (verl ``core_algos`` API); imports no torch.

Every name list of the algorithms is defined here once: the advantage estimators
(:class:`AdvantageEstimator`, ``algorithm.adv_estimator``), the policy-loss modes
(:class:`PolicyLossMode`, ``actor.policy_loss.loss_mode``), the loss aggregation modes
(``LOSS_AGG_MODES``), the KL estimators (``KL_PENALTY_TYPES``) and the KL-controller types
(``KL_CTRL_TYPES``).  rlhf.config builds its choices from them, so composing a config stays
torch-free.  The built-in estimators and losses register themselves when their modules
(rlhf.algorithms.estimators, rlhf.algorithms.policy_losses) are imported; every register / get
function here, reading a registry through rlhf.algorithms and importing core_algos import them
first, so a lookup always sees the built-ins (this module's own names stay empty until then: config
validation reads the declared names without importing torch).

The registries are one dict each: ``rlhf.algorithms.ADV_ESTIMATOR_REGISTRY``,
``rlhf.algorithms.core_algos.ADV_ESTIMATOR_REGISTRY`` and this module's name are the same object,
so mutating it (``.clear()``, ``[name] = fn``, ``.pop()``) works through any of them.  Mutate it
rather than rebind a name: ``core_algos.ADV_ESTIMATOR_REGISTRY = {...}`` rebinds only core_algos's
name, as for any module, and the register / get functions here keep using this module's dict.
"""

import difflib
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
    BYPASS_MODE = "bypass_mode"  # rollout correction's bypass mode (rlhf.algorithms.policy_losses.bypass)


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

#: the registry names rlhf.algorithms reads here on first access (loading the built-ins first)
REGISTRY_NAMES = ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY")

_builtins_imported = False


def load_builtins() -> None:
    """Import the built-in estimators and policy losses once (they register themselves; the
    registrations they make while importing do not re-enter).  Reading a registry through
    rlhf.algorithms, and every register / get function here, calls it; importing core_algos imports them."""
    global _builtins_imported
    if not _builtins_imported:
        _builtins_imported = True
        try:
            import rlhf.algorithms.estimators  # noqa: F401  (registration on import)
            import rlhf.algorithms.policy_losses  # noqa: F401
        except BaseException:
            _builtins_imported = False
            raise


def _name_of(name_or_enum: Union[str, Enum]) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def _unknown(kind: str, name: str, valid) -> ValueError:
    """verl's message (core_algos.get_adv_estimator_fn / get_policy_loss_fn), then the nearest name and all names."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    said = {"advantage estimator": "Unknown advantage estimator simply", "policy loss mode": "Unsupported loss mode"}
    return ValueError(f"{said[kind]}: {name}{hint}; valid: {sorted(valid)}")


def adv_estimator_names() -> list[str]:
    """Sorted names ``algorithm.adv_estimator`` accepts: the built-ins and whatever is registered now.
    Torch-free (the built-ins are not imported), for config validation."""
    return sorted({e.value for e in AdvantageEstimator} | set(ADV_ESTIMATOR_REGISTRY))


def policy_loss_names() -> list[str]:
    """Sorted names ``actor.policy_loss.loss_mode`` accepts (built-ins and registered ones); torch-free.
    :func:`get_policy_loss_fn` also accepts them with "-" for "_"."""
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
