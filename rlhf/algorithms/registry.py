"""Name registries of advantage estimators and policy losses (verl ``core_algos`` API).

``algorithm.adv_estimator`` selects an estimator from ADV_ESTIMATOR_REGISTRY and
``actor.policy_loss.loss_mode`` a policy loss from POLICY_LOSS_REGISTRY.  The
registry functions read this module's globals at call time, so replacing a
registry through ``rlhf.algorithms.core_algos`` (as verl's tests do) takes effect.
"""

from enum import Enum
from typing import Any, Callable, Optional, Union

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


#: ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
#: -> (loss, metrics)``, verl's policy-loss calling convention.
PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str, Any, Optional[torch.Tensor]],
    tuple[torch.Tensor, dict],
]

ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def _name_of(name_or_enum: Union[str, Enum]) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum: Union[str, Enum]) -> Callable:
    """Decorator registering an advantage estimator under a name (str or Enum value).

    Registering the same function twice is a no-op.

    Raises:
        ValueError: the name is already registered to a different function.
    """

    def decorator(fn: Callable) -> Callable:
        name = _name_of(name_or_enum)
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to {ADV_ESTIMATOR_REGISTRY[name]}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: Union[str, Enum]) -> Callable:
    """Return the estimator registered under ``name_or_enum`` (case-sensitive).

    Raises:
        ValueError: unknown name; the message lists the registered names.
    """
    name = _name_of(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str, override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (``actor.policy_loss.loss_mode``).

    Registering the same function twice is a no-op; replacing a registered loss
    needs ``override=True`` (so a typo cannot silently shadow a built-in loss).

    Raises:
        ValueError: the name is taken by a different function and ``override`` is False.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if not override and POLICY_LOSS_REGISTRY.get(name, fn) is not fn:
            raise ValueError(
                f"policy loss {name!r} is already registered to {POLICY_LOSS_REGISTRY[name]}; "
                "pass override=True to replace it"
            )
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """Return the policy loss registered under ``name``; ``clip-cov`` finds ``clip_cov``.

    Raises:
        ValueError: unknown name; the message lists the registered names.
    """
    for candidate in (name, name.replace("-", "_")):
        if candidate in POLICY_LOSS_REGISTRY:
            return POLICY_LOSS_REGISTRY[candidate]
    raise ValueError(f"unknown policy loss mode {name!r}; valid: {sorted(POLICY_LOSS_REGISTRY)}")
