"""Disaggregated transport: ``update_weights_from_distributed`` over one weight-update group per PP stage.

Group ``{prefix}_g{generation}_pp{p}``: rank 0 is stage p's leader, engine i's TP ranks follow at
``1 + i * tp_size`` (NCCL on GPU, gloo on CPU).  Each stage broadcasts its own buckets straight to the
engines, one flat message per bucket (SGLang's ``load_format="flattened_bucket"``); the controller only
issues the requests (names, dtypes, shapes), for a bucket its leader reported produced, tells the leader whether to
broadcast it, and waits for the engines (:meth:`DistributedTransport.run`).  SGLang always broadcasts from group
rank 0, hence one group per stage.  Groups are rebuilt (new generation) when the engines change
(an engine was replaced), since a replaced engine is no longer a member.
"""
from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist

from parallel.distributed import route_address
from rlhf.weight_bridge.bucketing import dtype_name
from rlhf.weight_bridge.plan import SendPlan
from rlhf.weight_bridge.validate import WeightBridgeError

__all__ = ["DistributedTransport", "free_port", "reachable_address", "interface_address", "resolve_address"]


def free_port() -> int:
    """A TCP port free on this host now (for a group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def reachable_address() -> str:
    """This host's address as the engines will dial it: the IP of the interface that routes outward
    (``gethostbyname(gethostname())`` gives 127.0.1.1 on stock Ubuntu); 127.0.0.1 without a route."""
    return route_address("10.255.255.255")  # a non-local address: the outward route


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
        raise ValueError(f"rollout.weight_update_address='iface:{name}': this host has no IPv4 address on "
                         f"interface {name!r}; its interfaces: {names}") from None


def resolve_address(spec: str | None) -> str:
    """The address engines dial for a weight-update group (``rollout.weight_update_address``).

    spec: None -> :func:`reachable_address`; ``"iface:<name>"`` -> :func:`interface_address` of that
    interface on this rank's host; anything else (an IP or host name) as is.  Raises ValueError (see
    interface_address)."""
    if not spec:
        return reachable_address()
    if spec.startswith("iface:"):
        return interface_address(spec[len("iface:"):])
    return spec


class DistributedTransport:
    """The weight-update groups of one trainer rank (persistent across syncs) and their delivery.

    Args:
        topo: the topology; engines: the engines' handle on the controller (None elsewhere);
        prefix: group name prefix; backend: "nccl" / "gloo"; master_address: address engines dial
            (:func:`resolve_address`: None, ``"iface:<name>"`` or an address); timeout_s: group timeout.
    """

    def __init__(self, topo, engines, prefix: str, backend: str, master_address: str | None, timeout_s: float):
        self.topo, self.engines, self.prefix, self.backend = topo, engines, prefix, backend
        self.master_address, self.timeout_s = master_address, timeout_s
        self.pg = None  # this leader's group
        self.fingerprint = None
        self.generation = 0
        self.group_names: dict[int, str] = {}

    def report(self) -> dict:
        """What this stage leader adds to its plan report: a rendezvous address and port."""
        return {"addr": resolve_address(self.master_address), "port": free_port()}

    def setup(self, plan: SendPlan, reports: dict, fingerprint) -> None:
        """Collective: (re)create every stage's group.  ``reports``: ``{pp_rank: {"addr", "port"}}``
        (known to every rank).  Raises WeightBridgeError on every rank when an engine fails to join."""
        self.close(engines_too=False)
        self.generation += 1
        topo, timeout = self.topo, datetime.timedelta(seconds=self.timeout_s)
        tp, n = (self.engines.tp_size, self.engines.num_engines) if topo.is_controller else (None, None)
        world = topo.broadcast_object(None if not topo.is_controller else 1 + n * tp)
        names = {s.pp_rank: f"{self.prefix}_g{self.generation}_pp{s.pp_rank}" for s in plan.stages}

        def join(p):
            from sglang.srt.utils.common import init_custom_process_group

            r = reports[p]
            return init_custom_process_group(backend=self.backend, init_method=f"tcp://{r['addr']}:{r['port']}",
                                             world_size=world, rank=0, group_name=names[p], timeout=timeout)

        error = None
        if topo.is_controller:
            pending = []
            for s in plan.stages:
                r = reports[s.pp_rank]
                pending += self.engines.init_weights_update_group(r["addr"], r["port"], world_size=world,
                                                                  group_name=names[s.pp_rank], backend=self.backend,
                                                                  rank_offsets=[1 + i * tp for i in range(n)])
            try:
                self.pg = join(plan.stages[0].pp_rank)
                self.engines.wait(pending, "init_weights_update_group")
            except Exception as e:  # noqa: BLE001 - every rank must learn about it
                error = f"{type(e).__name__}: {e}"
        elif topo.is_leader:
            self.pg = join(topo.pp_rank)
        error = topo.broadcast_object(error)
        if error:
            raise WeightBridgeError(f"weight-update groups could not be set up: {error}")
        self.group_names, self.fingerprint = names, fingerprint

    def request(self, plan: SendPlan, stage, bplan, last: bool) -> list:
        """Controller: ask every engine to receive ``bplan`` of ``stage``; returns what :meth:`wait` takes."""
        return self.engines.update_weights_from_distributed(bplan.names, [dtype_name(m.dtype) for m in bplan.metas],
                                                            [list(m.shape) for m in bplan.metas],
                                                            self.group_names[stage.pp_rank], flush_cache=last,
                                                            load_format="flattened_bucket")

    def broadcast(self, buf: torch.Tensor, times: dict) -> None:
        """Stage leader: send one flat bucket to every engine of its group."""
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0, group=self.pg)
        times["deliver"] += time.perf_counter() - t0

    def close(self, engines_too: bool = True) -> None:
        """Leave this rank's group; with ``engines_too`` (controller) ask the engines to drop theirs."""
        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception:  # noqa: BLE001 - best effort
                pass
            self.pg = None
        if engines_too and self.topo.is_controller and self.engines is not None:
            for name in self.group_names.values():
                try:
                    self.engines.destroy_weights_update_group(name)
                except Exception:  # noqa: BLE001 - a replaced engine never had it
                    pass
        self.group_names = {}

    def run(self, plan: SendPlan, my_stage, own, pool, record, times) -> str | None:
        """A stage leader's part of a sync (``own()`` yields ``(bucket plan, slot, buffer)``, or an exception in
        place of the buffer after a production error, hf_stream.stage_buckets; ``record`` sees each buffer).

        Per bucket, the colocated transport's decision (local_handles.py, steps 1-2): a leader other than the
        controller reports whether it produced the bucket; the controller asks the engines to receive it only when
        it was produced and nothing failed before, and tells that leader whether to broadcast.  So no engine waits
        in a broadcast that never comes (a leader that failed) and no leader broadcasts to engines whose request
        could not be started: either would hold the group until its timeout.  A leader whose own broadcast raised
        reports the failure with its next bucket, so the controller asks nothing more (no leader or controller is
        left waiting for the other).  Not covered: an engine that accepted a request and then fails before it joins
        the broadcast (its refusal comes back only with the engines' answer, after the data was sent).  Every leader
        goes through every bucket of its stage, also after an error (its TP peers' gathers).  Returns the first
        error (the controller: any rank's; another leader: its own), None when all went through."""
        if self.topo.is_controller:
            return self._run_controller(plan, my_stage, own, pool, record, times)
        return self._run_leader(plan, my_stage, own, pool, record, times)

    def _produced(self, it, plan: SendPlan, bplan, record) -> tuple:
        """The next item of a leader's stream for ``bplan``: ``(slot, buffer or None, error or None)``."""
        slot = None
        try:
            item = next(it, None)
            if item is None:
                raise RuntimeError(f"the stream ended before bucket {bplan.index}")
            got, slot, buf = item
            if isinstance(buf, BaseException):
                raise buf
            if got is not bplan:
                raise RuntimeError(f"bucket {got.index} produced where {bplan.index} was planned")
            record(plan, bplan, buf)
            return slot, buf, None
        except Exception as e:  # noqa: BLE001 - reported to the controller, then to every rank
            return slot, None, f"rank {self.topo.rank}: {type(e).__name__}: {e}"

    def _stream(self, own):
        """``own()``, or an empty stream and the error when it raised."""
        try:
            return own(), None
        except Exception as e:  # noqa: BLE001
            return iter(()), f"rank {self.topo.rank}: {type(e).__name__}: {e}"

    def _broadcast(self, buf, times) -> str | None:
        """:meth:`broadcast`; the error, or None."""
        try:
            self.broadcast(buf, times)
        except Exception as e:  # noqa: BLE001 - reported, never left between two ranks of the handshake
            return f"rank {self.topo.rank}: broadcast: {type(e).__name__}: {e}"
        return None

    def _run_controller(self, plan, my_stage, own, pool, record, times) -> str | None:
        error = None
        for stage in plan.stages:
            mine = None
            if stage is my_stage:
                mine, failed = self._stream(own)
                error = error or failed
            for bplan in stage.buckets:
                slot = buf = None
                if mine is not None:
                    slot, buf, failed = self._produced(mine, plan, bplan, record)
                else:
                    t0 = time.perf_counter()
                    failed = self.topo.recv_object(stage.leader)
                    times["receive"] += time.perf_counter() - t0
                error = error or failed
                pending, go = [], False
                if error is None:
                    try:
                        pending, go = self.request(plan, stage, bplan, plan.is_last(stage, bplan)), True
                    except Exception as e:  # noqa: BLE001
                        error = f"{type(e).__name__}: {e}"
                try:
                    if mine is None:
                        self.topo.send_object(go, stage.leader)
                    elif go:  # the engines that accepted the request wait for the data
                        error = error or self._broadcast(buf, times)
                finally:
                    pool.release(slot)
                t_wait = time.perf_counter()
                try:
                    self.engines.wait(pending, "update_weights_from_distributed")
                except Exception as e:  # noqa: BLE001
                    error = error or f"{type(e).__name__}: {e}"
                times["deliver"] += time.perf_counter() - t_wait
            if mine is not None:
                left = self._exhaust(mine)  # always: the TP peers' gathers
                error = error or left
        return error

    def _run_leader(self, plan, my_stage, own, pool, record, times) -> str | None:
        ctrl = self.topo.controller
        it, error = self._stream(own)
        for bplan in my_stage.buckets:
            slot, buf, failed = self._produced(it, plan, bplan, record)
            error = error or failed
            try:
                self.topo.send_object(error, ctrl)  # this rank's first error, also one of an earlier broadcast
                if self.topo.recv_object(ctrl):  # never after a failure: the controller asked no engine then
                    error = error or self._broadcast(buf, times)
            finally:
                pool.release(slot)
        left = self._exhaust(it)  # always: the TP peers' gathers
        return error or left

    def _exhaust(self, it) -> str | None:
        """Run a leader's stream to its end (it raises if it disagrees with the plan); the error, or None."""
        try:
            for _ in it:
                pass
        except Exception as e:  # noqa: BLE001
            return f"rank {self.topo.rank}: {type(e).__name__}: {e}"
        return None
