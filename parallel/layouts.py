"""A second megatron-core process grid over the same ranks, for a model whose tensor / pipeline parallel sizes differ
from the trainer's (the on-policy distillation teacher: rlhf.workers.teacher).

megatron-core keeps one process grid per process, in module globals of ``megatron.core.parallel_state`` that its
layers, its pipeline schedules and this package (parallel.forward, parallel.logprobs) read when they run.  A
:class:`ParallelLayout` builds a second grid once (``initialize_model_parallel`` with its sizes: collective, every
rank) and keeps those globals; ``with layout:`` puts them in place and puts the trainer's back on exit.  A model
built inside ``with layout:`` holds the layout's groups (megatron-core 0.16 layers take their groups from
parallel_state when built), and its forwards must run inside it too (the pipeline's send/receive, the vocab-parallel
log-softmax and the data-parallel slicing read parallel_state when called).

Not switched: megatron's RNG trackers (seeded per TP rank of the trainer's grid; a frozen model in eval mode draws
no random numbers) and the global memory buffer (shared).  Usage::

    layout = ParallelLayout(tp=2, pp=1)        # collective, after init_model_parallel
    with layout:
        bundle = build_model_chunks(...)       # the model's shards under tp=2
    ...
    with layout:
        out = forward(...)                     # collective over the layout's groups
"""
from __future__ import annotations

import re

import torch.distributed as dist

from .distributed import check_parallel_sizes

__all__ = ["ParallelLayout", "parallel_state_globals"]

_GLOBAL_NAME = re.compile(r"_[A-Z0-9_]+")
#: the gloo groups megatron-core's destroy_model_parallel destroys (the rest it only forgets)
_GLOO_GROUPS = ("_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
                "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO")


def parallel_state_globals() -> dict:
    """The module globals of megatron-core's parallel_state (its groups, ranks, sizes: every ``_UPPER_CASE`` name)."""
    from megatron.core import parallel_state as ps

    return {k: v for k, v in vars(ps).items() if _GLOBAL_NAME.fullmatch(k)}


def _put(state: dict) -> None:
    from megatron.core import parallel_state as ps

    for k, v in state.items():
        setattr(ps, k, v)


class ParallelLayout:
    """A megatron-core grid of tensor parallel size `tp` and pipeline parallel size `pp` (data parallel: the world
    size / (tp x pp); expert parallel 1, context parallel 1, no virtual pipeline) next to the trainer's.

    Collective: every rank constructs it, after ``parallel.distributed.init_model_parallel``; the trainer's grid is in
    place again when it returns.  Raises ValueError (parallel.distributed.check_parallel_sizes) when tp x pp does not
    divide the world size, RuntimeError without a trainer grid."""

    def __init__(self, tp: int, pp: int):
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("ParallelLayout needs the trainer's grid first "
                               "(parallel.distributed.init_model_parallel)")
        check_parallel_sizes(dist.get_world_size(), tp, pp)
        self.tp, self.pp = tp, pp
        trainer = parallel_state_globals()
        self._saved: list[dict] = []
        try:
            # destroy_model_parallel sets the globals to None (the groups live on in `trainer`), but it also
            # destroys the gloo groups it finds (megatron-core 0.16 parallel_state.destroy_model_parallel):
            # hide them, or the trainer's optimizer would keep handles to destroyed groups
            _put({k: None for k in _GLOO_GROUPS})
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            self._state = parallel_state_globals()
            self._state["_GLOBAL_MEMORY_BUFFER"] = trainer["_GLOBAL_MEMORY_BUFFER"]  # one buffer for both grids
        finally:
            _put(trainer)

    def __enter__(self) -> "ParallelLayout":
        self._saved.append(parallel_state_globals())
        _put(self._state)
        return self

    def __exit__(self, *exc) -> None:
        _put(self._saved.pop())

    def __repr__(self) -> str:
        return f"ParallelLayout(tp={self.tp}, pp={self.pp}, dp={dist.get_world_size() // (self.tp * self.pp)})"
