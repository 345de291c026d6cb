"""Where engines run: which GPUs each engine and trainer rank gets (a pure, tested function), and the
Ray options that put each engine actor there.

Trainer ranks follow the torchrun / srun convention: global rank r runs on node ``r // gpus_per_node``,
GPU ``r % gpus_per_node``.

* colocated: engine i shares the trainer's GPUs ``[i * tp, (i + 1) * tp)`` (global order), on every node of the
  trainer (verl's replica layout); the engines release their memory while the trainer computes.  The colocated
  weight sync hands each engine TP rank a CUDA IPC handle of memory of the trainer rank on its own GPU, which
  receives every pipeline stage's buckets from that stage's leader (rlhf/weight_bridge/from_tensor.py), with or
  without expert parallelism: a bucket crosses nodes by the trainer's broadcast and goes by CUDA IPC only within a
  node, so stage leaders and engines may be on any node of the trainer.
* disaggregated: engines take the GPUs after the trainer's, ``W + i * tp ...``, one node each.

A job's GPUs (:func:`job_placement_problem`; on a config :func:`placement_problems` and :func:`trainer_world_size`,
the config check of ``--cfg`` and ``--plan-memory``):
``trainer.nnodes x trainer.n_gpus_per_node``, the disaggregated engines' included: the trainer gets
``GPUs - rollout.num_engines x rollout.tensor_model_parallel_size`` of them (:func:`trainer_gpus`).

Engine actors claim no Ray GPU resources: the plan decides the devices (SGLang's ``base_gpu_id`` on a
node whose CUDA_VISIBLE_DEVICES Ray leaves alone) and the node (Ray node affinity).  Engines are never
restarted by Ray (``max_restarts=0``): the manager replaces a dead engine itself.

Ray nodes of a multi-node job (:func:`rank_ray_nodes`, :func:`gpu_engine_nodes`, :func:`cpu_engine_nodes`):
each trainer rank's node (its name, host name or IP, ``parallel.distributed.node_label``) is matched to a
Ray node; plan node k is the Ray node of trainer ranks ``k * gpus_per_node ...``, and disaggregated engines
beyond the trainer's nodes go to the other Ray nodes with GPUs.  On CPU (no plan) a disaggregated engine goes
to a Ray node other than trainer rank 0's (nodes without trainer ranks first), a colocated one to rank 0's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["GPU", "PlacementPlan", "PlacementError", "plan_placement", "engine_actor_options", "engines_start_early",
           "rank_ray_nodes", "gpu_engine_nodes", "cpu_engine_nodes", "describe_engine_nodes", "stage_leaders",
           "holder_ranks", "engine_gpus", "trainer_gpus", "job_placement_problem", "placement_problems",
           "trainer_world_size", "pool_engines", "pool_problems", "pool_placement", "pool_nodes"]


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


def stage_leaders(trainer_world_size: int, pp: int = 1) -> List[int]:
    """Global ranks of the pipeline stage leaders (TP rank 0 of data-parallel replica 0 of each stage) in
    megatron's default rank order (tp-cp-ep-dp-pp): ``s * W / pp`` for stage s.  Their buckets are what the
    colocated weight sync hands to the engines (rlhf/weight_bridge/from_tensor.py)."""
    pp = max(1, pp)
    return [s * (trainer_world_size // pp) for s in range(pp)]


def holder_ranks(num_engines: int, engine_tp: int, world: int, leader: int) -> Dict[Tuple[int, int], int]:
    """``{(engine, engine TP rank): trainer global rank}`` whose GPU that colocated engine rank runs on: ``e * tp + r``,
    the stage ``leader`` for an index past the trainer's ``world`` ranks.  The colocated weight sync serves each engine
    rank from that rank's memory (rlhf/weight_bridge/from_tensor.py)."""
    return {(e, r): (e * engine_tp + r if e * engine_tp + r < world else leader)
            for e in range(num_engines) for r in range(engine_tp)}


def plan_placement(*, nnodes: int, gpus_per_node: int, trainer_world_size: int, num_engines: int, engine_tp: int,
                   mode: str) -> PlacementPlan:
    """The devices of every trainer rank and engine (see module docstring).

    Raises:
        PlacementError: more trainer ranks than GPUs, an engine wider than a node or spanning two nodes,
            colocated engines beyond the trainer's GPUs, disaggregated engines beyond the free GPUs, or any GPU
            used twice.
    """
    total = nnodes * gpus_per_node
    if min(nnodes, gpus_per_node, trainer_world_size, num_engines, engine_tp) < 1:
        raise PlacementError("nnodes, gpus_per_node, trainer world size, num_engines and engine TP must be >= 1")
    if mode not in ("colocated", "disaggregated"):
        raise PlacementError(f"rollout.mode={mode!r}: use colocated or disaggregated")
    if trainer_world_size > total:
        raise PlacementError(f"{trainer_world_size} trainer ranks need {trainer_world_size} GPUs but {nnodes} node(s) "
                             f"x {gpus_per_node} GPUs = {total}")
    if engine_tp > gpus_per_node:
        same = num_engines * -(-engine_tp // gpus_per_node)  # engines of TP gpus_per_node on the same GPUs
        raise PlacementError(f"an engine with tensor parallel size {engine_tp} does not fit on a node of "
                             f"{gpus_per_node} GPUs, and an engine spanning nodes is not supported yet: set "
                             f"rollout.tensor_model_parallel_size to {gpus_per_node} or less and use the GPUs by data "
                             f"parallelism across engines instead (rollout.num_engines={same} engines of TP "
                             f"{gpus_per_node}: each holds the whole model, so its weights must fit {gpus_per_node} "
                             f"GPUs); expert parallelism inside an engine (SGLang's ep_size, verl's "
                             f"actor_rollout_ref.rollout.expert_parallel_size), for an MoE model that needs more, "
                             f"is not passed on yet")
    gpu = lambda g: GPU(g // gpus_per_node, g % gpus_per_node)  # noqa: E731 - global index -> GPU
    first = 0 if mode == "colocated" else trainer_world_size
    need = num_engines * engine_tp
    if mode == "colocated" and need > trainer_world_size:
        tp_too = "" if trainer_world_size >= engine_tp else " and rollout.tensor_model_parallel_size"
        raise PlacementError(f"{num_engines} engine(s) x TP {engine_tp} = {need} GPUs do not fit the trainer's "
                             f"{trainer_world_size} GPUs (colocated engines share them): lower rollout.num_engines to "
                             f"{max(trainer_world_size // engine_tp, 1)}{tp_too} or less, or use "
                             f"rollout.mode=disaggregated")
    if mode == "disaggregated" and first + need > total:
        raise PlacementError(f"{num_engines} engine(s) x TP {engine_tp} = {need} GPUs do not fit the "
                             f"{total - trainer_world_size} GPUs left after the trainer's {trainer_world_size} "
                             f"(disaggregated): lower rollout.num_engines or rollout.tensor_model_parallel_size, "
                             + (f"or start fewer trainer ranks (at most {total - need}: the launchers leave the "
                                f"engines' GPUs free, recipes/_launch/torchrun.sh), " if total > need else
                                f"since the engines alone need all {total} GPUs or more, ")
                             + "or use rollout.mode=colocated")
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


def pool_engines(rollout_nnodes: int, rollout_per_node: int, engine_tp: int) -> int:
    """Engines of verl's rollout pool (``rollout.nnodes x rollout.n_gpus_per_node`` GPUs, one-step-off recipes): one
    per ``engine_tp`` GPUs of each rollout node (verl's replicas of ``tensor_model_parallel_size``)."""
    return rollout_nnodes * (rollout_per_node // engine_tp)


def pool_problems(*, mode: str, num_engines: int, engine_tp: int, rollout_nnodes: int, rollout_per_node: int,
                  trainer_nnodes: int = 1, trainer_per_node: Optional[int] = None,
                  gpus_per_node: Optional[int] = None) -> List[str]:
    """Why verl's rollout pool does not place, one line each with the fix: disaggregated engines, whole engines per
    rollout node, ``num_engines`` the pool's (:func:`pool_engines`); with ``gpus_per_node``, each pool in a node."""
    pool, tp, out = f"rollout.nnodes={rollout_nnodes} x rollout.n_gpus_per_node={rollout_per_node}", engine_tp, []
    if mode != "disaggregated":
        out.append(f"rollout.n_gpus_per_node={rollout_per_node} gives the engines GPUs of their own (verl's rollout "
                   f"pool, {pool}) but rollout.mode={mode}; set actor_rollout_ref.hybrid_engine=False (or "
                   f"rollout.mode=disaggregated), as verl's one-step-off recipes do, or drop rollout.nnodes / "
                   f"rollout.n_gpus_per_node.")
    if rollout_per_node % tp:
        out.append(f"rollout.n_gpus_per_node={rollout_per_node} is not a multiple of the engines' tensor parallel "
                   f"size rollout.tensor_model_parallel_size={tp} (verl: actor_rollout_ref.rollout.tensor_model_"
                   f"parallel_size; each rollout node runs rollout.n_gpus_per_node / TP engines); set "
                   f"rollout.n_gpus_per_node to a multiple of {tp}.")
    elif num_engines != pool_engines(rollout_nnodes, rollout_per_node, tp):
        out.append(f"rollout.num_engines={num_engines} but verl's rollout pool {pool} at engine tensor parallel "
                   f"size {tp} runs {pool_engines(rollout_nnodes, rollout_per_node, tp)} engine(s); drop "
                   f"rollout.num_engines (the pool sets it) or the pool keys.")
    if out or not gpus_per_node or not trainer_per_node:
        return out
    for key, n in (("trainer.n_gpus_per_node", trainer_per_node), ("rollout.n_gpus_per_node", rollout_per_node)):
        if n > gpus_per_node:
            return [f"verl's pools (trainer.nnodes={trainer_nnodes} x trainer.n_gpus_per_node={trainer_per_node}, "
                    f"{pool}) on nodes of {gpus_per_node} GPUs: {key}={n} is more than a node's {gpus_per_node} "
                    f"GPUs: set {key} to {gpus_per_node} or less and use more nodes ({key.split('.')[0]}.nnodes)."]
    return []


def pool_placement(*, gpus_per_node: int, trainer_nnodes: int, trainer_per_node: int, rollout_nnodes: int,
                   rollout_per_node: int, engine_tp: int) -> PlacementPlan:
    """verl's separate trainer and rollout pools (its one-step-off ``create_resource_pool_manager``:
    ``[trainer.n_gpus_per_node] * trainer.nnodes`` and ``[rollout.n_gpus_per_node] * rollout.nnodes``) on nodes of
    ``gpus_per_node`` GPUs, by the rule of verl's one_step_off_policy README: when both pools' GPUs per node fit a
    node, they share nodes (``max(trainer.nnodes, rollout.nnodes)`` nodes; on node k the trainer's GPUs first, then
    the engines'), else the rollout pool takes nodes of its own after the trainer's (``trainer.nnodes +
    rollout.nnodes``).  Trainer rank r on node ``r // trainer_per_node``, GPU ``r % trainer_per_node``; each rollout
    node runs ``rollout_per_node / engine_tp`` engines.

    Raises:
        PlacementError: the first of :func:`pool_problems` (the engine TP does not divide ``rollout_per_node``, a
            pool wider than a node), or a size below 1.
    """
    if min(gpus_per_node, trainer_nnodes, trainer_per_node, rollout_nnodes, rollout_per_node, engine_tp) < 1:
        raise PlacementError("GPUs per node, both pools' nodes and GPUs per node and the engine TP must be >= 1")
    for problem in pool_problems(mode="disaggregated", num_engines=pool_engines(rollout_nnodes, rollout_per_node,
                                 engine_tp), engine_tp=engine_tp, rollout_nnodes=rollout_nnodes, rollout_per_node=
                                 rollout_per_node, trainer_nnodes=trainer_nnodes, trainer_per_node=trainer_per_node,
                                 gpus_per_node=gpus_per_node):
        raise PlacementError(problem.rstrip("."))
    shared = trainer_per_node + rollout_per_node <= gpus_per_node
    trainer = [GPU(r // trainer_per_node, r % trainer_per_node) for r in range(trainer_nnodes * trainer_per_node)]
    engines = []
    for k in range(rollout_nnodes):
        node = k if shared else trainer_nnodes + k
        first = trainer_per_node if shared and k < trainer_nnodes else 0
        engines += [[GPU(node, first + j * engine_tp + x) for x in range(engine_tp)]
                    for j in range(rollout_per_node // engine_tp)]
    return PlacementPlan(trainer, engines)


def pool_nodes(gpus_per_node: int, trainer_nnodes: int, trainer_per_node: int, rollout_nnodes: int,
               rollout_per_node: int) -> int:
    """Nodes the two pools need (:func:`pool_placement`): ``max`` of both pools' nodes when they share nodes, else the
    sum (verl's one_step_off_policy README)."""
    shared = trainer_per_node + rollout_per_node <= gpus_per_node
    return max(trainer_nnodes, rollout_nnodes) if shared else trainer_nnodes + rollout_nnodes


def engine_gpus(mode: str, num_engines: int, engine_tp: int) -> int:
    """GPUs the engines take beside the trainer's: ``num_engines x engine_tp`` disaggregated, 0 colocated."""
    return num_engines * engine_tp if mode == "disaggregated" else 0


def trainer_gpus(mode: str, gpus: int, num_engines: int, engine_tp: int) -> int:
    """Trainer ranks of a job of ``gpus`` GPUs: all of them colocated, those the engines leave disaggregated
    (may be < 1: the caller refuses)."""
    return gpus - engine_gpus(mode, num_engines, engine_tp)


def job_placement_problem(*, mode: str, num_engines: int, engine_tp: int, gpus_per_node: int, nnodes: int = 1,
                          trainer_world_size: Optional[int] = None,
                          gpus_from: str = "trainer.nnodes x trainer.n_gpus_per_node") -> Optional[str]:
    """Why the job does not place (one line naming the config values and the fix), None when it does.

    Args:
        gpus_per_node, nnodes: the job's GPUs (disaggregated engines' included); ``gpus_from`` says where they
            came from, for the message.
        trainer_world_size: the trainer ranks (the launcher's); None: :func:`trainer_gpus` (what the launchers
            start).
    """
    total = gpus_per_node * nnodes
    world = trainer_world_size if trainer_world_size is not None else trainer_gpus(mode, total, num_engines, engine_tp)
    head = (f"rollout.mode={mode} with rollout.num_engines={num_engines} x rollout.tensor_model_parallel_size="
            f"{engine_tp} on {total} GPUs ({gpus_from} = {nnodes} x {gpus_per_node})")
    if world < 1:
        return (f"{head}: the engines take {engine_gpus(mode, num_engines, engine_tp)} GPUs and leave none for the "
                f"trainer; lower rollout.num_engines or rollout.tensor_model_parallel_size, add GPUs (trainer.nnodes), "
                f"or use rollout.mode=colocated.")
    try:
        plan_placement(nnodes=nnodes, gpus_per_node=gpus_per_node, trainer_world_size=world, num_engines=num_engines,
                       engine_tp=engine_tp, mode=mode)
    except PlacementError as e:
        return f"{head}, trainer on {world}: {e}."
    return None


def trainer_world_size(cfg: Any, world_size: Optional[int]) -> tuple[Optional[int], list[str], Optional[str]]:
    """The trainer processes of config ``cfg`` as (count, problems, where it came from): ``world_size`` (the
    launcher's; source None), else what the launchers start for the job's GPUs (:func:`trainer_gpus`), with the keys
    that say so (for the messages); None when neither says."""
    gpus, nodes, r = cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes or 1, cfg.rollout
    declared = gpus * nodes if gpus and gpus >= 1 and nodes >= 1 else None
    if declared is None or (world_size is not None and r.get("n_gpus_per_node")):
        return world_size, [], None
    keys = f"trainer.nnodes={nodes} x trainer.n_gpus_per_node={gpus}"
    if r.get("n_gpus_per_node"):  # verl's pools: trainer.* are the trainer's GPUs alone, the engines have their own
        return declared, [], f"{keys} (verl's trainer pool)"
    if r.mode != "colocated":
        trainer = trainer_gpus(r.mode, declared, r.num_engines, r.tensor_model_parallel_size)
        if world_size is not None or trainer < 1:
            return world_size, [], None
        return trainer, [], (f"{keys} less the engines' rollout.num_engines={r.num_engines} x "
                             f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}")
    if cfg.trainer.nnodes is None:
        return world_size, [], None
    if world_size is not None and world_size != declared:
        return world_size, [f"trainer.n_gpus_per_node={gpus} x trainer.nnodes={nodes} = {declared} but the job has "
                            f"{world_size} trainer processes; launch {declared} (e.g. torchrun --nproc_per_node={gpus}"
                            f" --nnodes={nodes}) or set both to null (as launched)."], None
    return (declared, [], keys) if world_size is None else (world_size, [], None)


def placement_problems(cfg: Any, world_size: Optional[int] = None,
                       gpus_per_node: Optional[int] = None) -> list[str]:
    """The engines and trainer ranks of config ``cfg`` fit the job's GPUs: trainer.n_gpus_per_node (else
    ``gpus_per_node``) x trainer.nnodes (else the nodes the ranks fill); no check without a GPU count, nor for
    disaggregated engines of a job as launched on several nodes (they may run on Ray nodes beyond the trainer's).
    verl's trainer and rollout pools: :func:`pool_problems`, on nodes of ``gpus_per_node``
    GPUs (known at the start of a run)."""
    r, t = cfg.rollout, cfg.trainer
    if r.get("n_gpus_per_node"):  # the fields' own rules report a size below 1
        return [] if min(r.n_gpus_per_node, r.nnodes or 1, r.tensor_model_parallel_size) < 1 else pool_problems(
            mode=r.mode, num_engines=r.num_engines, engine_tp=r.tensor_model_parallel_size,
            rollout_nnodes=r.nnodes or 1, rollout_per_node=r.n_gpus_per_node, trainer_nnodes=t.nnodes or 1,
            trainer_per_node=t.n_gpus_per_node, gpus_per_node=gpus_per_node)
    declared = t.n_gpus_per_node if t.n_gpus_per_node and t.n_gpus_per_node >= 1 else None
    per_node = declared or gpus_per_node
    if min(r.num_engines, r.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) < 1 or \
            not per_node or (t.nnodes is not None and t.nnodes < 1):
        return []  # the sections' own rules report a bad size
    nnodes = t.nnodes or (-(-world_size // per_node) if world_size else 1)
    if r.mode == "disaggregated" and not t.nnodes and nnodes > 1:
        return []
    src = (f"{'trainer.nnodes' if t.nnodes else 'nodes'} x "
           f"{'trainer.n_gpus_per_node' if declared else 'GPUs per node (trainer.n_gpus_per_node=null)'}")
    why = job_placement_problem(mode=r.mode, num_engines=r.num_engines, engine_tp=r.tensor_model_parallel_size,
                                gpus_per_node=per_node, nnodes=nnodes, trainer_world_size=world_size, gpus_from=src)
    return [why] if why else []


def engines_start_early(mode: str, device: str) -> bool:
    """Whether the rollout engines may start while the trainer builds its models (rather than after them): when
    their memory does not depend on what the trainer allocates.  On CPU SGLang's KV pool has the configured size
    (``rollout.max_total_tokens``, or the batch-sized default); disaggregated engines have GPUs of their own.
    Colocated GPU engines size their KV cache from the memory left once the trainer's models are resident
    (SGLang's ``mem_fraction_static`` profile of free memory), so they start after the models.  ``device``: the
    trainer's device type; any accelerator ("cuda", the tests' fake "meta") is treated as a GPU.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in ("colocated", "disaggregated"):
        raise ValueError(f"rollout.mode must be 'colocated' or 'disaggregated', got {mode!r}")
    return device == "cpu" or mode == "disaggregated"


def engine_actor_options(index: int, *, env: Dict[str, str], plan: Optional[PlacementPlan] = None,
                         node_ids: Optional[List[str]] = None,
                         actor_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``ray.remote(...).options(...)`` of engine ``index``.  With a ``plan`` (GPU): the engine's node through
    ``node_ids[node]`` (Ray node ids by plan node index; None: anywhere) and the plan's GPUs (the actor sees
    all GPUs of its node; ``base_gpu_id`` goes into the engine's kwargs).  Without (a light CPU actor):
    ``node_ids`` are the engines' nodes, engine i on ``node_ids[i % len(node_ids)]`` (None: anywhere)."""
    env = dict(env)
    opts: Dict[str, Any] = {"max_restarts": 0, "max_concurrency": 1, "num_cpus": 0, "num_gpus": 0,
                            "runtime_env": {"env_vars": env}}
    if plan is not None:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    if node_ids:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = node_ids[plan.engine_node(index)] if plan is not None else node_ids[index % len(node_ids)]
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    opts.update(actor_options or {})
    return opts


def _alive(ray_nodes: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [n for n in ray_nodes if n.get("Alive", True)]


def rank_ray_nodes(labels: Optional[List[Sequence[str]]], ray_nodes: List[Dict[str, Any]], driver_node: str,
                   world_size: int) -> List[Optional[str]]:
    """The Ray node id of each trainer rank (None where it cannot be told).

    Args:
        labels: ``(name, hostname, ip)`` per rank (``parallel.distributed.rank_nodes``), or None (unknown).
        ray_nodes: ``ray.nodes()`` (``NodeID``, ``Alive``, ``NodeName``, ``NodeManagerHostname``,
            ``NodeManagerAddress``).
        driver_node: the Ray node of rank 0's driver (``ray.get_runtime_context().get_node_id()``): rank 0's
            node when its label matches no single Ray node (several Ray nodes on one host).
    A label matches the one alive Ray node with that ``NodeName``, else host name, else IP address; with one
    alive Ray node every rank is on it.
    """
    alive = _alive(ray_nodes)
    if len(alive) == 1:  # a one-node Ray cluster: every rank that uses it is there
        return [alive[0]["NodeID"]] * world_size

    def match(label: Sequence[str]) -> Optional[str]:
        for key, value in zip(("NodeName", "NodeManagerHostname", "NodeManagerAddress"), label):
            hits = [n["NodeID"] for n in alive if n.get(key) == value]
            if len(hits) == 1:
                return hits[0]
        return None

    out = [match(x) for x in labels] if labels else [None] * world_size
    out[0] = out[0] or driver_node
    return out


def _names(ray_nodes: List[Dict[str, Any]]) -> Dict[str, str]:
    return {n["NodeID"]: n.get("NodeName") or n["NodeID"][:8] for n in ray_nodes}


def gpu_engine_nodes(rank_nodes: List[Optional[str]], gpus_per_node: int, ray_nodes: List[Dict[str, Any]],
                     mode: str) -> tuple[int, List[str]]:
    """``(nnodes, node_ids)`` for :func:`plan_placement` and :func:`engine_actor_options` on GPU: plan node k is
    the Ray node of trainer ranks ``k * gpus_per_node ...``; disaggregated: then the other alive Ray nodes with
    GPUs, by name.

    Raises:
        PlacementError: trainer ranks of one plan node on different (or unknown) Ray nodes, or one Ray node
            holding two plan nodes' ranks: the ranks must be laid out torchrun's / srun's way (rank r on node
            r // gpus_per_node), each node of the job in the Ray cluster.
    """
    names, trainer = _names(ray_nodes), []
    for k in range(-(-len(rank_nodes) // gpus_per_node)):
        ranks = range(k * gpus_per_node, min((k + 1) * gpus_per_node, len(rank_nodes)))
        found = {rank_nodes[r] for r in ranks}
        if None in found or len(found) != 1 or found <= set(trainer):
            where = ", ".join(f"rank {r}: {names.get(rank_nodes[r], 'not a Ray node')}" for r in ranks)
            raise PlacementError(f"trainer ranks {ranks.start}-{ranks.stop - 1} should share plan node {k} but are "
                                 f"on [{where}]: run {gpus_per_node} ranks per node in rank order and join every "
                                 f"node to the Ray cluster (ray start --node-name=<host>, or RLHF_NODE_NAME=<its "
                                 f"Ray node name> for the trainer)")
        trainer.append(found.pop())
    if mode != "disaggregated":
        return len(trainer), trainer
    extra = sorted((n for n in _alive(ray_nodes) if n["NodeID"] not in trainer and n.get("Resources", {}).get("GPU")),
                   key=lambda n: n.get("NodeName") or "")
    return len(trainer) + len(extra), trainer + [n["NodeID"] for n in extra]


def cpu_engine_nodes(rank_nodes: List[Optional[str]], ray_nodes: List[Dict[str, Any]], mode: str,
                     num_engines: int = 1, engine_tp: int = 1) -> Optional[List[str]]:
    """The Ray nodes of CPU engines (engine i on ``[i % len]``), None with a one-node Ray cluster (anywhere).

    colocated: engine i on the node of trainer rank ``i * engine_tp``, the rank that serves its TP rank 0 in the
    weight sync (:func:`holder_ranks`: the one whose memory it maps), rank 0's past the
    trainer's ranks; disaggregated: every alive Ray node except rank 0's, those hosting no trainer rank first, then
    by name (rank 0's when it is the only node).
    """
    alive = _alive(ray_nodes)
    if len(alive) <= 1:
        return None
    rank0, busy = rank_nodes[0], set(rank_nodes)
    if mode != "disaggregated":
        return [rank_nodes[i * engine_tp] if i * engine_tp < len(rank_nodes) and rank_nodes[i * engine_tp] else rank0
                for i in range(num_engines)]
    others = sorted((n for n in alive if n["NodeID"] != rank0),
                    key=lambda n: (n["NodeID"] in busy, n.get("NodeName") or ""))
    return [n["NodeID"] for n in others] or [rank0]


def describe_engine_nodes(num_engines: int, node_ids: Optional[List[str]], ray_nodes: List[Dict[str, Any]],
                          plan: Optional[PlacementPlan] = None) -> str:
    """One line: the Ray node (name) of every engine."""
    if not node_ids:
        return f"{num_engines} engine(s) on any Ray node"
    names = _names(ray_nodes)
    where = [node_ids[plan.engine_node(i)] if plan is not None else node_ids[i % len(node_ids)]
             for i in range(num_engines)]
    return ", ".join(f"engine {i} on Ray node {names.get(n, n)}" for i, n in enumerate(where))
