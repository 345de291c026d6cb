"""Distributed state: torch.distributed from torchrun or Slurm, megatron model parallelism, seeding.

Typical use on every rank::

    from parallel.distributed import init_distributed, init_model_parallel, set_seed
    init_distributed()                 # NCCL on GPU, gloo on CPU
    init_model_parallel(tp=2, pp=2)    # megatron-core parallel_state (ep= for MoE)
    set_seed(1234)                     # per-rank seeding, megatron RNG trackers
"""
from __future__ import annotations

import datetime
import os
import random
import re
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from parallel import cpu_patches  # noqa: F401  (must precede megatron.core imports)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job: global rank, world size, local rank, rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as ``"gpu-[01-03,07],cpu1"`` into host names, in Slurm's order.

    Pure python, the same result as ``scontrol show hostnames``: zero padding kept (``[08-10]``), several
    bracket groups per name expand as a cartesian product with the first group outermost
    (``"rack[1-2]-node[01-02]"`` -> rack1-node01, rack1-node02, rack2-node01, rack2-node02).
    Raises ValueError on an unbalanced bracket, an empty group or a range that is not ``lo-hi`` digits
    with ``lo <= hi``.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        hosts.extend(_expand_host(part, nodelist))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Split on the commas outside brackets; checks the brackets balance."""
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in SLURM node list {nodelist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {nodelist!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {nodelist!r}")
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _expand_host(part: str, nodelist: str) -> list[str]:
    """One comma-free item: expand its first bracket group, then the rest of the name recursively."""
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)", part)
    if not m:
        return [part]
    prefix, ranges, rest = m.groups()
    tails = _expand_host(rest, nodelist) if rest else [""]
    values: list[str] = []
    for r in ranges.split(","):
        lo, sep, hi = r.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {r!r} in SLURM node list {nodelist!r}: use digits like [01-04,07]")
        if not sep:
            values.append(lo)
            continue
        if int(lo) > int(hi):
            raise ValueError(f"range {r!r} in SLURM node list {nodelist!r} runs backwards")
        width = len(lo)
        values.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    return [f"{prefix}{v}{tail}" for v in values for tail in tails]


#: First port of a Slurm job's block of three (torch.distributed rendezvous, Ray GCS, Ray client server);
#: recipes/_launch/slurm_body.sh uses the same formula.  20000-32001 stays below Linux's ephemeral range.
SLURM_PORT_BASE, SLURM_PORT_BLOCKS = 20000, 4000


def slurm_job_ports(job_id: int) -> tuple[int, int, int]:
    """Ports of a Slurm job derived from its id: ``(master_port, ray_gcs_port, ray_client_port)``.

    ``base = 20000 + 3 * (job_id % 4000)``; two jobs sharing a node get different ports unless their
    ids differ by a multiple of 4000.  Raises ValueError for a negative id.
    """
    if job_id < 0:
        raise ValueError(f"SLURM_JOB_ID={job_id} must be >= 0")
    base = SLURM_PORT_BASE + 3 * (job_id % SLURM_PORT_BLOCKS)
    return base, base + 1, base + 2


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now ("": on every interface, for a rendezvous other hosts dial)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def detect_launch_env(environ: dict | None = None) -> LaunchEnv:
    """Read rank/world size from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or Slurm (SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID, MASTER_ADDR from the first host of SLURM_JOB_NODELIST, MASTER_PORT from
    :func:`slurm_job_ports` of SLURM_JOB_ID when unset).

    torchrun wins when both are set (torchrun inside an srun allocation). With neither, a single
    process job on a free local port.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        master = env.get("MASTER_ADDR") or expand_slurm_nodelist(nodelist)[0]
        default_port = slurm_job_ports(int(env["SLURM_JOB_ID"]))[0] if env.get("SLURM_JOB_ID") else 29500
        port = int(env.get("MASTER_PORT", default_port))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         master, port, "slurm")
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "single")


def node_label(environ: dict | None = None) -> tuple[str, str, str]:
    """``(name, hostname, ip)`` of this process's node, to find it among the Ray cluster's nodes.

    name: ``RLHF_NODE_NAME``, else ``SLURMD_NODENAME`` (the recipes' Slurm body names each Ray node after its
    Slurm node), else the host name; ip: the local address of the route to ``MASTER_ADDR`` (127.0.0.1 when
    there is none).
    """
    env = os.environ if environ is None else environ
    host = socket.gethostname()
    ip = route_address(env.get("MASTER_ADDR") or "127.0.0.1")
    return env.get("RLHF_NODE_NAME") or env.get("SLURMD_NODENAME") or host, host, ip


def route_address(dest: str) -> str:
    """This host's IPv4 address on the interface that routes to `dest` (a UDP connect picks the route and sends
    nothing); 127.0.0.1 when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def interface_address(name: str) -> str:
    """IPv4 address of network interface `name` (Linux; e.g. ``ib0``, ``eth0``, ``lo``).

    Raises ValueError naming the interface and the interfaces this host has when it has no IPv4 address."""
    import fcntl
    import struct

    names = [n for _, n in socket.if_nameindex()]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        raise ValueError(f"this host has no IPv4 address on interface {name!r}; its interfaces: {names}") from None


def resolve_address(spec: str | None, setting: str = "address") -> str:
    """The address other processes dial for a group this host opens (``setting`` names the option in errors):
    None -> the IP of the interface that routes outward (``gethostbyname(gethostname())`` gives 127.0.1.1 on stock
    Ubuntu); ``"iface:<name>"`` -> that interface's address on this host (ValueError naming the setting when it has no
    IPv4 address); anything else (an IP, a host name) as is."""
    if not spec:
        return route_address("10.255.255.255")  # a non-local address: the outward route
    if spec.startswith("iface:"):
        try:
            return interface_address(spec[len("iface:"):])
        except ValueError as e:
            raise ValueError(f"{setting}={spec!r}: {e}") from None
    return spec


_RANK_NODES: list[tuple[str, str, str]] | None = None


def rank_nodes() -> list[tuple[str, str, str]] | None:
    """:func:`node_label` of every global rank (index = rank), gathered by :func:`init_distributed`; None
    before it ran (or when the process group was made elsewhere)."""
    return _RANK_NODES


def init_distributed(backend: str | None = None, timeout_minutes: int = 30) -> LaunchEnv:
    """Initialise the default process group (idempotent) and gather every rank's :func:`node_label`
    (:func:`rank_nodes`).

    backend: None picks "nccl" when CUDA is available, else "gloo" (and applies the CPU patches).
    Returns the LaunchEnv. Raises ValueError for an unknown backend.
    """
    global _RANK_NODES
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend={backend!r}: use 'nccl' (GPU), 'gloo' (CPU) or None (auto)")
    launch = detect_launch_env()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        cpu_patches.apply_cpu_patches()
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        dist.init_process_group(backend=backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
        labels: list = [None] * dist.get_world_size()
        dist.all_gather_object(labels, node_label())
        _RANK_NODES = [tuple(x) for x in labels]
    return launch


def check_parallel_sizes(world: int, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                         etp: int | None = None, cp: int = 1) -> None:
    """Check a megatron-core process grid before building it; raises ValueError naming the value and the fix.

    Dense grid: world = tp x cp x pp x dp (cp: context parallel).  Expert grid (megatron-core's second decomposition of the same
    ranks): world = etp x ep x pp x edp with etp (expert tensor parallel) defaulting to tp, so
    ep x etp x pp must divide the world size as well.
    """
    if tp < 1 or pp < 1 or cp < 1 or world % (tp * pp * cp) != 0:
        cp_part = f" x cp={cp}" if cp != 1 else ""
        raise ValueError(f"tp={tp}{cp_part} x pp={pp} must divide world_size={world}; launch tp*{'cp*' if cp != 1 else ''}"
                         f"pp*dp processes")
    if vpp is not None and (vpp < 1 or pp == 1):
        raise ValueError(f"vpp={vpp} needs pp > 1 and vpp >= 1 (got pp={pp}); use vpp=None")
    etp_ = tp if etp is None else etp
    if ep < 1 or etp_ < 1 or world % (ep * etp_ * pp) != 0:
        room = world // (etp_ * pp) if world % (etp_ * pp) == 0 else "n/a"
        raise ValueError(f"expert parallel ep={ep} x expert tp={etp_} x pp={pp} must divide world_size={world}; "
                         f"choose ep dividing world_size / (pp * expert tp) = {room}")


def init_model_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                        etp: int | None = None, cp: int = 1) -> None:
    """megatron-core `initialize_model_parallel`: tensor (tp), pipeline (pp, virtual vpp) and expert
    (ep, expert tensor parallel etp, default tp) and context (cp; GPU only, see parallel.context_parallel)
    parallel groups; DP is world_size / (tp * cp * pp).

    Uneven pipelines are not a process-group setting: pass `num_layers_in_first/last_pipeline_stage`
    to `parallel.models.build_model_chunks` (they go to the TransformerConfig).
    Raises ValueError for sizes that do not divide the world (see `check_parallel_sizes`).
    Idempotent for the same sizes; different sizes tear the old groups down first.
    """
    from megatron.core import parallel_state as ps

    check_parallel_sizes(dist.get_world_size(), tp, pp, vpp, ep, etp, cp)
    etp_ = tp if etp is None else etp
    if ps.model_parallel_is_initialized():
        current = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_world_size(), ps.get_context_parallel_world_size())
        if current == (tp, pp, vpp, ep, etp_, cp):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp_, context_parallel_size=cp)


def compute_device() -> torch.device:
    """The device this rank computes on: ``cuda:<current>`` when CUDA is available, else ``cpu``.

    The one device rule (see `parallel.devices`): models live here; each role (actor, critic, reference)
    moves a batch here once when it comes in; forward outputs come back on the batch's device.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch on this rank and megatron's TP/DP/EP RNG trackers.

    Same `seed` on every rank: megatron derives the per-TP-rank streams (seed + 2718 + tp_rank).
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_patches.apply_cpu_patches()
        cpu_patches.model_parallel_cpu_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down megatron parallel state and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    global _RANK_NODES
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK_NODES = None
