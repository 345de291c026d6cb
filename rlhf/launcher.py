"""One command per node: ``python -m rlhf.main ...`` started without torchrun starts this node's trainer ranks
itself, with torch's elastic agent (the launcher of ``torch.distributed.run``, used as a library).

Ranks on this node: the node's GPUs (``trainer.n_gpus_per_node`` when set, else the visible GPUs; with
``rollout.mode=disaggregated`` on one node, minus the engines' ``rollout.num_engines x
rollout.tensor_model_parallel_size``: they take the GPUs after the trainer's), else (CPU) tensor x pipeline
parallel size / ``trainer.nnodes`` (the smallest job the config runs as).  With verl's pools
(``rollout.n_gpus_per_node``, its one-step-off recipes' ``actor_rollout_ref.hybrid_engine=False``):
``trainer.n_gpus_per_node`` is the trainer's pool alone, so that many ranks on each of the ``trainer.nnodes``
nodes (unset: the visible GPUs less ``rollout.n_gpus_per_node``); rollout-only nodes run no trainer rank (they
join the Ray cluster only).  recipes/_launch/torchrun.sh and
slurm_body.sh ask the same (``python -m rlhf.main --print-launch=GPUS ...``).

Nodes: ``trainer.nnodes`` (default 1).  With several nodes, every node runs the same command and the agents
meet at a static rendezvous (torchrun's ``--nnodes=N --node_rank=R --master_addr=A --master_port=P``):

* from the environment: ``NODE_RANK`` (0 .. nnodes-1), ``MASTER_ADDR`` (node 0's address), ``MASTER_PORT``
  (default 29500); node 0 hosts global rank 0;
* inside a Slurm step of ONE task per node (``srun --ntasks-per-node=1``): ``SLURM_NODEID``, the first host of
  ``SLURM_JOB_NODELIST`` and the job's port (``parallel.distributed.slurm_job_ports``), unless
  ``MASTER_ADDR`` / ``MASTER_PORT`` are set.

A process started by torchrun, or a task of an srun step with one task per rank (recipes' run_slurm.sbatch),
is one rank and trains itself; so does a one-rank, one-node job (no extra process).  A missing or bad
rendezvous setting is a config error (exit code 2) before anything starts; a worker's failure ends the run
with that worker's exit code (128 + signal when killed).
"""
from __future__ import annotations

import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from rlhf.config import ConfigError
from rlhf.launch_env import LaunchEnv

__all__ = ["NodeLaunch", "LaunchConfigError", "local_ranks", "plan_launch", "run_node", "DEFAULT_MASTER_PORT"]

DEFAULT_MASTER_PORT = 29500
#: seconds the agents wait for every node to join (``RLHF_RENDEZVOUS_TIMEOUT`` overrides)
DEFAULT_RENDEZVOUS_TIMEOUT_S = 900


class LaunchConfigError(ConfigError):
    """The job's size or rendezvous settings do not work (``rlhf.main`` prints it and exits 2)."""


@dataclass(frozen=True)
class NodeLaunch:
    """What this node's agent starts: ``nproc_per_node`` ranks of a job of ``nnodes`` nodes; this node is
    ``node_rank``; the rendezvous at ``master_addr:master_port`` (None on one node: a free local port, as
    ``torchrun --standalone``); ``source`` says where the settings came from (``local``, ``env``, ``slurm``)."""

    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    source: str

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_ranks(cfg, cuda_count: Optional[int] = None) -> int:
    """Trainer ranks per node for ``cfg`` (see the module docstring); ``cuda_count`` None asks torch.

    Raises:
        LaunchConfigError: on CPU, tensor x pipeline parallel not divisible by trainer.nnodes; on one node of
            GPUs with disaggregated engines, no GPU left for the trainer.
    """
    nnodes = cfg.trainer.nnodes or 1
    r, declared = cfg.rollout, cfg.trainer.n_gpus_per_node
    if r.get("n_gpus_per_node") and r.mode == "disaggregated":  # verl's pools: trainer.* is the trainer's alone
        if declared:
            return int(declared)
        gpus = _cuda_count() if cuda_count is None else cuda_count
        if gpus and gpus - r.n_gpus_per_node < 1:
            raise LaunchConfigError(
                f"rollout.n_gpus_per_node={r.n_gpus_per_node} (verl's rollout pool) takes all of this node's {gpus} "
                f"GPUs and trainer.n_gpus_per_node is not set; set trainer.n_gpus_per_node=<the trainer's GPUs per "
                f"node> (verl's trainer pool), e.g. {max(gpus - 1, 1)} with rollout.n_gpus_per_node=1")
        if gpus:
            return gpus - r.n_gpus_per_node  # one node shared by both pools: the trainer's GPUs first
    gpus = int(declared) if declared else _cuda_count() if cuda_count is None else cuda_count
    if gpus:
        if r.mode == "disaggregated" and nnodes == 1:
            engines = r.num_engines * r.tensor_model_parallel_size
            if gpus - engines < 1:
                where = f"trainer.n_gpus_per_node={gpus}" if declared else f"this node's {gpus} GPUs"
                raise LaunchConfigError(
                    f"rollout.mode=disaggregated: rollout.num_engines={r.num_engines} engine(s) x "
                    f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} take {engines} of {where} "
                    f"and leave none for the trainer; lower rollout.num_engines, use rollout.mode=colocated, or "
                    f"add nodes (trainer.nnodes)")
            return gpus - engines
        return gpus
    mp = (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
          * cfg.parallel.get("context_parallel_size", 1))
    if mp % nnodes:
        raise LaunchConfigError(
            f"tensor x context x pipeline parallel = {mp} ranks do not split over trainer.nnodes={nnodes} nodes; set "
            f"trainer.n_gpus_per_node=<ranks per node> (a multiple of {mp} in all) or another trainer.nnodes")
    return mp // nnodes


def _int_env(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchConfigError(f"{name}={raw!r} is not an integer") from None


def _rendezvous_env(nnodes: int, env: Mapping[str, str]) -> tuple[int, str, int, str]:
    """(node_rank, master_addr, master_port, source) of a multi-node job; raises LaunchConfigError."""
    how = (f"on every node run the same command with NODE_RANK=<0..{nnodes - 1}> MASTER_ADDR=<node 0's address> "
           f"MASTER_PORT=<a free port on node 0> (e.g. NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 "
           f"python -m rlhf.main ... trainer.nnodes={nnodes}), or start one task per node under Slurm "
           f"(srun --ntasks-per-node=1 python -m rlhf.main ... trainer.nnodes={nnodes})")
    if "SLURM_NODEID" in env and "SLURM_JOB_NODELIST" in env and "NODE_RANK" not in env:
        from parallel.distributed import expand_slurm_nodelist, slurm_job_ports

        node_rank = _int_env(env, "SLURM_NODEID")
        addr = env.get("MASTER_ADDR") or expand_slurm_nodelist(env["SLURM_JOB_NODELIST"])[0]
        job = _int_env(env, "SLURM_JOB_ID")
        port = _int_env(env, "MASTER_PORT", slurm_job_ports(job)[0] if job is not None else DEFAULT_MASTER_PORT)
        source = "slurm"
    else:
        missing = [k for k in ("NODE_RANK", "MASTER_ADDR") if not env.get(k)]
        if missing:
            raise LaunchConfigError(f"trainer.nnodes={nnodes}: {' and '.join(missing)} not set, so this node's "
                                    f"place in the job is unknown; {how}")
        node_rank, addr = _int_env(env, "NODE_RANK"), env["MASTER_ADDR"]
        port = _int_env(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
        source = "env"
    if not 0 <= node_rank < nnodes:
        raise LaunchConfigError(f"node rank {node_rank} (from {'SLURM_NODEID' if source == 'slurm' else 'NODE_RANK'}) "
                                f"is outside 0..{nnodes - 1} for trainer.nnodes={nnodes}")
    if not 0 < port < 65536:
        raise LaunchConfigError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    try:
        socket.getaddrinfo(addr, port)
    except OSError as e:
        raise LaunchConfigError(f"MASTER_ADDR={addr!r} does not resolve ({e}); give node 0's address or "
                                f"host name as every node can reach it") from None
    return node_rank, addr, port, source


def plan_launch(cfg, env: LaunchEnv, environ: Optional[Mapping[str, str]] = None,
                cuda_count: Optional[int] = None) -> Optional[NodeLaunch]:
    """What this process should start, or None when it is a rank itself (torchrun, one srun task per rank,
    a one-rank one-node job).

    Args:
        cfg: the composed config (``trainer.nnodes``, ``trainer.n_gpus_per_node``, parallel and rollout keys).
        env: :func:`rlhf.launch_env.launch_env` of this process.
        environ: the environment (default ``os.environ``): NODE_RANK, MASTER_ADDR, MASTER_PORT, SLURM_*.
        cuda_count: visible GPUs (None: ask torch).
    Raises:
        LaunchConfigError: a rendezvous setting missing or bad (message names it and the fix).
    """
    environ = os.environ if environ is None else environ
    nnodes = cfg.trainer.nnodes or 1
    if env.launcher == "torchrun":
        return None
    if env.launcher == "slurm":
        # a node's launcher only in a step of one task per node for a declared multi-node job
        one_per_node = env.world_size == nnodes and _int_env(environ, "SLURM_STEP_NUM_NODES",
                                                            _int_env(environ, "SLURM_NNODES", nnodes)) == nnodes
        if not (cfg.trainer.nnodes and one_per_node):
            return None
        nproc = local_ranks(cfg, cuda_count)
        if nproc == 1:
            return None  # each task is already the one rank of its node
        node_rank, addr, port, source = _rendezvous_env(nnodes, environ)
        return NodeLaunch(nproc, nnodes, node_rank, addr, port, source)
    nproc = local_ranks(cfg, cuda_count)
    if nnodes == 1:
        return None if nproc == 1 else NodeLaunch(nproc, 1, 0, None, None, "local")
    node_rank, addr, port, source = _rendezvous_env(nnodes, environ)
    return NodeLaunch(nproc, nnodes, node_rank, addr, port, source)


def _worker_env(plan: NodeLaunch, cuda: bool) -> None:
    """Defaults of recipes/_launch/torchrun.sh for the workers (they inherit os.environ)."""
    if cuda:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core keeps TP/SP comms ordered
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc_per_node)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_node(plan: NodeLaunch, argv: Sequence[str], module: str = "rlhf.main") -> int:
    """Start this node's ``plan.nproc_per_node`` ranks, each ``python -m <module> <argv>``, through torch's
    elastic agent (no restarts), and wait for them.  Returns 0, the first failed rank's exit code (128 +
    signal number when killed), or 1 when the rendezvous failed (one line naming the address and the fix)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _worker_env(plan, cuda=_cuda_count() > 0)
    timeout = int(os.environ.get("RLHF_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_TIMEOUT_S))
    if plan.nnodes == 1:  # torchrun --standalone: c10d rendezvous on a free local port
        rdzv = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=str(uuid.uuid4()))
    else:  # torchrun --nnodes=N --node_rank=R --master_addr=A --master_port=P (static rendezvous, run id "none")
        rdzv = dict(rdzv_backend="static", rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}", run_id="none",
                    rdzv_configs={"rank": plan.node_rank, "timeout": timeout})
    config = LaunchConfig(min_nodes=plan.nnodes, max_nodes=plan.nnodes, nproc_per_node=plan.nproc_per_node,
                          max_restarts=0, **rdzv)
    where = "" if plan.nnodes == 1 else (f" as node {plan.node_rank} of {plan.nnodes} (rendezvous "
                                         f"{plan.master_addr}:{plan.master_port}, from {plan.source})")
    # print, not logging: this is the node's launcher, not a rank (no logging set up, no progress bar), and job
    # logs are searched for its "[rlhf.main] ..." lines at the start of a line
    print(f"[rlhf.main] starting {plan.nproc_per_node} rank(s) on {socket.gethostname()}{where}", flush=True)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", module, *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        print(f"[rlhf.main] rank {rank} exited with {failure.exitcode}; stopping this node's ranks", file=sys.stderr,
              flush=True)
        return code or 1
    except Exception as e:  # noqa: BLE001 - the agent's rendezvous errors have no common base class
        if plan.nnodes == 1:
            raise
        print(f"[rlhf.main] node {plan.node_rank}: the rendezvous of {plan.nnodes} nodes at {plan.master_addr}:"
              f"{plan.master_port} failed ({type(e).__name__}: {e}); start the same command on every node within "
              f"RLHF_RENDEZVOUS_TIMEOUT={timeout} s, node 0 at MASTER_ADDR, and check the port is free and "
              f"reachable", file=sys.stderr, flush=True)
        return 1
    return 0
