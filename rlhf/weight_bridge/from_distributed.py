"""Disaggregated transport: ``update_weights_from_distributed`` over one weight-update group per PP stage (docs/gpu.md).

Group ``{prefix}_{uuid}_pp{p}``: rank 0 is stage p's leader (SGLang broadcasts from group rank 0), engine i's TP
ranks follow at ``1 + i * tp_size`` (NCCL on GPU, gloo on CPU); one flat message per bucket
(``load_format="flattened_bucket"``).  Not covered: an engine that accepted a request and fails before it joins the
broadcast (its refusal comes back after the data).
"""
from __future__ import annotations

import contextlib
import datetime
import time
import uuid

import torch
import torch.distributed as dist

from parallel.distributed import free_port, resolve_address
from rlhf.weight_bridge.delivery import Delivery
from rlhf.weight_bridge.plan import SendPlan, WeightBridgeError

__all__ = ["DistributedGroups", "DistributedDelivery"]


class DistributedGroups:
    """One trainer rank's weight-update groups, kept across syncs (``master_address``: rollout.weight_update_address,
    parallel.distributed.resolve_address)."""

    def __init__(self, topo, engines, prefix: str, backend: str, master_address: str | None, timeout_s=1800.0):
        self.topo, self.engines, self.prefix, self.backend = topo, engines, prefix, backend
        self.master_address, self.timeout_s = master_address, timeout_s
        self.pg = None  # this leader's group
        self.fingerprint = None  # the engines' fingerprint the groups were made with
        self.group_names: dict[int, str] = {}

    def report(self) -> dict:
        """What a stage leader adds to its plan report: a rendezvous address and port."""
        return {"addr": resolve_address(self.master_address, "rollout.weight_update_address"), "port": free_port("")}

    def setup(self, plan: SendPlan, reports: dict, fingerprint) -> None:
        """Collective: (re)create every stage's group (the engines leave the previous one).  ``reports``: ``{pp_rank:
        {"addr", "port"}}`` (every rank).  Raises WeightBridgeError on every rank when a leader or an engine fails to
        join, or an engine was replaced meanwhile (it would never join a broadcast)."""
        self.close()
        topo, timeout = self.topo, datetime.timedelta(seconds=self.timeout_s)
        tp, n = (self.engines.tp_size, self.engines.num_engines) if topo.is_controller else (None, None)
        # names of this setup's own (the controller's, for every rank): an engine still holding an earlier bridge's
        # group refuses a second group of the same name
        world, names = topo.broadcast_object(None if not topo.is_controller else (1 + n * tp, {
            s.pp_rank: f"{self.prefix}_{uuid.uuid4().hex[:8]}_pp{s.pp_rank}" for s in plan.stages}))

        error, pending = None, []
        try:
            if topo.is_controller:  # the engines' joins first: a leader's blocks until they come
                for s in plan.stages:
                    r = reports[s.pp_rank]
                    pending += self.engines.init_weights_update_group(
                        r["addr"], r["port"], world_size=world, group_name=names[s.pp_rank], backend=self.backend,
                        rank_offsets=[1 + i * tp for i in range(n)])
            if topo.is_leader:  # the controller leads stage 0
                from sglang.srt.utils.common import init_custom_process_group

                r = reports[topo.pp_rank]
                self.pg = init_custom_process_group(backend=self.backend, init_method=f"tcp://{r['addr']}:{r['port']}",
                                                    world_size=world, rank=0, group_name=names[topo.pp_rank],
                                                    timeout=timeout)
            if topo.is_controller:
                self.engines.wait(pending, "init_weights_update_group")
                if self.engines.fingerprint() != fingerprint:
                    raise RuntimeError("an engine was replaced while joining; sync again")
        except Exception as e:  # noqa: BLE001 - every rank must learn about it
            error = f"rank {topo.rank}: {type(e).__name__}: {e}"
        errors = [e for e in topo.all_gather_object(error) if e]
        if errors:
            raise WeightBridgeError(f"weight-update groups could not be set up: {'; '.join(errors)}")
        self.group_names, self.fingerprint = names, fingerprint

    def close(self) -> None:
        """Leave this rank's group; the controller asks the engines to drop theirs."""
        if self.pg is not None:
            with contextlib.suppress(Exception):  # best effort
                dist.destroy_process_group(self.pg)
            self.pg = None
        self.fingerprint = None
        if self.topo.is_controller and self.engines is not None:
            for name in self.group_names.values():
                with contextlib.suppress(Exception):  # a replaced engine never had it
                    self.engines.destroy_weights_update_group(name)
        self.group_names = {}


class DistributedDelivery(Delivery):
    """A disaggregated sync's delivery: the decision is the engines' receive request, made before the leader's
    broadcast; none once an engine was replaced since ``begin_sync`` (``token``): it would never join the broadcast."""

    def __init__(self, topo, engines, record, times: dict, groups: DistributedGroups, token=None):
        super().__init__(topo, engines, record, times)
        self.groups, self.token, self._requested = groups, token, None

    def start(self, plan, stage, bplan) -> bool:
        gone = self.engines.replaced_since(self.token) if self.token is not None else []
        if gone:
            raise RuntimeError(f"engine(s) {gone} replaced during the sync: they are in no weight-update group")
        dtypes = [str(m.dtype).removeprefix("torch.") for m in bplan.metas]  # "float32": SGLang's spelling
        self._requested = self.engines.update_weights_from_distributed(
            bplan.names, dtypes, [list(m.shape) for m in bplan.metas], self.groups.group_names[stage.pp_rank],
            flush_cache=plan.is_last(stage, bplan), load_format="flattened_bucket")
        return True

    def move(self, plan, stage, bplan, buf, go):
        if buf is not None:  # the controller leads this stage; the engines that accepted wait for the data
            t0 = time.perf_counter()
            self.lead(stage, bplan, buf, go)
            self.times["deliver"] += time.perf_counter() - t0
        return self._requested  # also after a failed broadcast: the requests still get their answers

    def lead(self, stage, bplan, buf: torch.Tensor, go) -> None:
        try:
            dist.broadcast(buf, src=0, group=self.groups.pg)
        except Exception as e:  # noqa: BLE001 - a leader reports it with its next bucket
            self.fail(f"rank {self.topo.rank}: broadcast: {type(e).__name__}: {e}")

    def wait(self, call) -> None:
        self.engines.wait(call, "update_weights_from_distributed")
