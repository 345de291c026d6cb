"""Make a facade module forward the registry names to registry.py BY REFERENCE.

``core_algos.ADV_ESTIMATOR_REGISTRY = {...}`` (as verl's tests do) must rebind
the registry that ``register_adv_est`` / ``get_adv_estimator_fn`` use, and
reading the name must always give the live object.  Reads go through a
module ``__getattr__`` (PEP 562, the names are never bound in the facade);
writes through the module class's ``__setattr__``.
"""

import sys
import types
from typing import Any

from rlhf.algorithms import registry

FORWARDED = ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY")


class _ForwardingModule(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in FORWARDED:
            setattr(registry, name, value)
        else:
            super().__setattr__(name, value)


def forwarded_getattr(module_name: str):
    """A PEP 562 ``__getattr__`` for ``module_name`` that resolves FORWARDED names in registry.py."""

    def __getattr__(name: str) -> Any:
        if name in FORWARDED:
            return getattr(registry, name)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


def install(module_name: str) -> None:
    """Switch ``sys.modules[module_name]`` to the forwarding module class."""
    sys.modules[module_name].__class__ = _ForwardingModule
