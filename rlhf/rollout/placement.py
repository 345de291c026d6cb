"""Where engines run: which GPUs each engine and trainer rank gets (a pure, tested function), and the
Ray options that put each engine actor there.

Trainer ranks follow the torchrun / srun convention: global rank r runs on node ``r // gpus_per_node``,
GPU ``r % gpus_per_node``.

* colocated: engine i shares the trainer's GPUs ``[i * tp, (i + 1) * tp)`` (global order), which must lie
  on one node; the engines release their memory while the trainer computes.
* disaggregated: engines take the GPUs after the trainer's, ``W + i * tp ...``, one node each.

Engine actors claim no Ray GPU resources: the plan decides the devices (SGLang's ``base_gpu_id`` on a
node whose CUDA_VISIBLE_DEVICES Ray leaves alone) and the node (Ray node affinity).  Engines are never
restarted by Ray (``max_restarts=0``): the manager replaces a dead engine itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

__all__ = ["GPU", "PlacementPlan", "PlacementError", "plan_placement", "engine_actor_options"]


class PlacementError(ValueError):
    """A layout that does not fit or double-books a GPU; the message names the numbers and the fix."""


@dataclass(frozen=True)
class GPU:
    node: int
    index: int  # on its node


@dataclass
class PlacementPlan:
    """trainer[r]: the GPU of global trainer rank r; engines[i]: engine i's GPUs (TP rank order)."""

    trainer: List[GPU]
    engines: List[List[GPU]]

    def engine_node(self, i: int) -> int:
        return self.engines[i][0].node

    def base_gpu_id(self, i: int) -> int:
        return self.engines[i][0].index


def plan_placement(*, nnodes: int, gpus_per_node: int, trainer_world_size: int, num_engines: int, engine_tp: int,
                   mode: str) -> PlacementPlan:
    """The devices of every trainer rank and engine (see module docstring).

    Raises:
        PlacementError: more trainer ranks than GPUs, an engine spanning two nodes, engines beyond the
            trainer's GPUs (colocated) or beyond the free GPUs (disaggregated), or any GPU used twice.
    """
    total = nnodes * gpus_per_node
    if min(nnodes, gpus_per_node, trainer_world_size, num_engines, engine_tp) < 1:
        raise PlacementError("nnodes, gpus_per_node, trainer world size, num_engines and engine TP must be >= 1")
    if mode not in ("colocated", "disaggregated"):
        raise PlacementError(f"rollout.mode={mode!r}: use colocated or disaggregated")
    if trainer_world_size > total:
        raise PlacementError(f"{trainer_world_size} trainer ranks need {trainer_world_size} GPUs but {nnodes} node(s) x "
                             f"{gpus_per_node} GPUs = {total}")
    if engine_tp > gpus_per_node:
        raise PlacementError(f"an engine with tensor parallel size {engine_tp} does not fit on a node of "
                             f"{gpus_per_node} GPUs: lower rollout.tensor_model_parallel_size")
    gpu = lambda g: GPU(g // gpus_per_node, g % gpus_per_node)  # noqa: E731 - global index -> GPU
    first = 0 if mode == "colocated" else trainer_world_size
    limit = trainer_world_size if mode == "colocated" else total
    need = num_engines * engine_tp
    if first + need > limit:
        where = (f"the trainer's {trainer_world_size} GPUs (colocated)" if mode == "colocated"
                 else f"the {total - trainer_world_size} GPUs left after the trainer's {trainer_world_size} (disaggregated)")
        raise PlacementError(f"{num_engines} engine(s) x TP {engine_tp} = {need} GPUs do not fit {where}: lower "
                             f"rollout.num_engines or rollout.tensor_model_parallel_size")
    engines = []
    for i in range(num_engines):
        gpus = [gpu(first + i * engine_tp + k) for k in range(engine_tp)]
        if len({g.node for g in gpus}) > 1:
            raise PlacementError(f"engine {i} would span nodes {sorted({g.node for g in gpus})}: its tensor parallel "
                                 f"size {engine_tp} must divide the GPUs per node ({gpus_per_node}) at its offset")
        engines.append(gpus)
    trainer = [gpu(r) for r in range(trainer_world_size)]
    used = [g for e in engines for g in e]
    if len(set(used)) != len(used) or (mode == "disaggregated" and set(used) & set(trainer)):
        raise PlacementError("a GPU would be used twice")  # unreachable by construction; kept as the invariant
    return PlacementPlan(trainer, engines)


def engine_actor_options(index: int, *, env: Dict[str, str], plan: Optional[PlacementPlan] = None,
                         node_ids: Optional[List[str]] = None,
                         actor_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``ray.remote(...).options(...)`` of engine ``index``.  With a ``plan`` (GPU): the engine's node through
    ``node_ids[node]`` (Ray node ids by plan node index; None: anywhere) and the plan's GPUs (the actor sees
    all GPUs of its node; ``base_gpu_id`` goes into the engine's kwargs).  Without: a light CPU actor."""
    env = dict(env)
    opts: Dict[str, Any] = {"max_restarts": 0, "max_concurrency": 1, "num_cpus": 0, "num_gpus": 0,
                            "runtime_env": {"env_vars": env}}
    if plan is not None:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        if node_ids is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_ids[plan.engine_node(index)], soft=False)
    opts.update(actor_options or {})
    return opts
