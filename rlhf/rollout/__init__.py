"""Rollout generation with SGLang engines.

* :mod:`rlhf.rollout.sampling` -- :class:`SamplingConfig`, :func:`stop_token_ids_for`
* :mod:`rlhf.rollout.types` -- :class:`RolloutSample`
* :mod:`rlhf.rollout.engine` -- :class:`RolloutEngine` (one ``sglang.Engine`` in a child process),
  :class:`EngineDiedError`, :class:`EngineCallError`
* :mod:`rlhf.rollout.ray_engines` -- :class:`RolloutEngineActor`, :class:`RolloutManager` (several engines,
  restart on crash, colocated / disaggregated placement)
* :mod:`rlhf.rollout.sglang_cpu` -- everything needed to run SGLang on a CPU-only machine

Names are imported lazily so that ``python -m rlhf.rollout.engine`` (the engine child) and light users
do not import torch / ray up front.
"""

import importlib

_EXPORTS = {
    "SamplingConfig": "sampling", "stop_token_ids_for": "sampling",
    "RolloutSample": "types",
    "RolloutEngine": "engine", "EngineDiedError": "engine", "EngineCallError": "engine", "PendingCall": "engine",
    "RolloutEngineActor": "ray_engines", "RolloutManager": "ray_engines",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
