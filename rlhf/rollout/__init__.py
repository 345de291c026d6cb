"""Rollout generation with SGLang engines.

* :mod:`rlhf.rollout.sampling` -- :class:`SamplingConfig`, :func:`stop_token_ids_for`
* :mod:`rlhf.rollout.types` -- :class:`RolloutSample`
* :mod:`rlhf.rollout.sglang_engine` -- :class:`SGLangEngine`, the Ray actor owning one ``sglang.Engine``
* :mod:`rlhf.rollout.manager` -- :class:`RolloutManager` (several engines: generic fan-out, generation
  split/merge, replacement of dead engines, colocated memory release/resume)
* :mod:`rlhf.rollout.engine_args`, :mod:`rlhf.rollout.placement` -- how engines are started and placed
* :mod:`rlhf.rollout.sglang_cpu` -- everything needed to run SGLang on a CPU-only machine

Names are imported lazily so that light users do not import torch / ray up front.
"""

import importlib

_EXPORTS = {
    "SamplingConfig": "sampling", "stop_token_ids_for": "sampling",
    "RolloutSample": "types",
    "SGLangEngine": "sglang_engine", "EngineCallError": "sglang_engine",
    "RolloutManager": "manager", "RolloutFailedError": "manager", "StaleEnginesError": "manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
