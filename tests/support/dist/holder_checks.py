"""Engine-local bucket handles (rlhf/weight_bridge/local_handles.py) on 4 gloo ranks with in-memory engines.
Launched by tests/e2e/test_bridge_holders_dist.py (shared 4-rank launch, tests/e2e/conftest.py):

    torchrun --nproc_per_node=4 tests/support/dist/holder_checks.py --workdir DIR

Per trainer layout (tiny Llama; under expert parallelism a tiny Qwen3-MoE of 8 experts; megatron-core, the real
WeightBridge on every rank; the engines are tests/support/fakes.py's FakeEngines on rank 0, which deserialize every
entry with SGLang's serializer):

* ``placed_on_two_nodes`` (EP layouts): the 4 ranks as 2 simulated nodes of 2 GPUs (rank r on node ``r // 2``, the
  placement's numbering; the bridge knows no nodes): the colocated placement check passes with stage leaders (PP2:
  ranks 0 and 2) or engines on both nodes under EP (refused before: every engine mapped the leaders' buckets), and
  every engine rank's entries of every bucket come from a rank of its own node (CUDA IPC works only within one);

* ``entry_from_rank_on_its_device``: engine e's TP-rank-r entry of EVERY bucket (every pipeline stage's) is shared
  memory created by trainer rank ``e * engine_tp + r`` (the pid in torch's ``/torch_<pid>_`` file name);
* ``entries_bitwise_equal_checkpoint``: every engine TP rank received bitwise the checkpoint's tensors (the trainer
  was built from it and did not step);
* ``failed_sync_serializes_only_what_is_delivered``: an engine refusing its second bucket fails the sync on every
  rank (no hang), and the handles serialized on all ranks equal the entries handed to the engines (a serialized
  CUDA IPC handle never opened would keep its block in torch's IPC limbo for good);
* ``replaced_engine_serializes_only_what_is_delivered``: the same when an engine is replaced during the sync (it
  gets nothing after its replacement; the others get every bucket);
* ``pools_freed_after_the_engines_last_reply``: every rank frees its bucket pool only after the engines answered
  the last bucket (the engine's last reply is made slow: 0.5 s);
* ``broadcast_on_an_existing_group``: the holders' broadcasts use the world group (members = every rank) or the
  tensor-parallel group (members = one TP group: layout ``tp2pp1_1x2``): no ``new_group`` in the sync (on a GPU
  each group is one more NCCL communicator per member);
* ``production_error_raises_on_every_rank``: the last stage's leader fails its 3rd
  conversion (fault point ``sync_convert_error``): the sync raises WeightBridgeError naming the fault on every
  rank within ``WATCHDOG_S`` (its TP peer goes on issuing gathers; a leader that stopped gathering left it in
  ``dist.gather`` until the process group's timeout: the watchdog prints FAIL and ends the launch), and the next
  sync is fine on every rank (no collective left behind);
* ``expert_peer_error_raises_on_every_rank`` (EP layouts): the same with the fault on stage 0's expert peer of TP
  rank 0 (it converts its routed experts and holds: its error is kept until its last broadcast and collective).

Prints ``CHECK holders_<layout>_<name> PASS|FAIL <detail>`` on rank 0.
"""
import argparse
import os
import re
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.distributed import init_distributed, init_model_parallel, set_seed  # noqa: E402
from tests.support.dist.checks import report_rank0 as report  # noqa: E402 (rank 0 decides)

#: (trainer tp, trainer pp, trainer ep, engines, engine tp): world 4
LAYOUTS = [
    (2, 2, 1, 2, 2),  # TP peers of both stage leaders hold engine ranks; stage 1's leader holds one of its own
    (1, 2, 1, 1, 4),  # data-parallel replica ranks (no part in any gather) hold engine ranks of both stages
    (2, 1, 1, 2, 2),  # PP 1: a TP peer and a data-parallel replica's ranks hold
    (2, 1, 1, 1, 2),  # PP 1, one engine: the leader and its TP peer hold (the holders are one TP group)
    # EP: each stage's expert peer holds, its part in the leader's EP gathers between the broadcasts (stage 1's leader
    # and expert peer hold stage 0's buckets on node 1)
    (1, 2, 2, 2, 2),
    # TP2 x EP2: the leader's TP peer (an expert entry is 2 x its tensors on the leader), the expert peer and its TP
    # peer (routed experts only, TP gather then EP gathers) hold
    (2, 1, 2, 2, 2),
]
CHECKS = ["entry_from_rank_on_its_device", "entries_bitwise_equal_checkpoint",
          "failed_sync_serializes_only_what_is_delivered", "replaced_engine_serializes_only_what_is_delivered",
          "pools_freed_after_the_engines_last_reply", "broadcast_on_an_existing_group",
          "production_error_raises_on_every_rank"]
SLOW_LAST_REPLY_S = 0.5
WATCHDOG_S = 120  # a sync of this tiny model takes seconds; a peer left in a gather waits for the group timeout
LOAD_DELAY_S = 0.03  # the engines' loading of a bucket starts this long after the update call


def layout_name(tp, pp, ep, n, etp):
    return f"tp{tp}pp{pp}{f'ep{ep}' if ep > 1 else ''}_{n}x{etp}"


def checks(ep):
    return CHECKS + (["placed_on_two_nodes", "expert_peer_error_raises_on_every_rank"] if ep > 1 else [])


class Fleet:
    """FakeEngines that load asynchronously, as SGLang engines do: an update call only records its payloads, the
    engines map and copy them when the trainer waits for the call, ``LOAD_DELAY_S`` later (so a trainer buffer
    rewritten before the engines answered shows as a wrong value).  Per update call it records the pid that
    created each entry's memory and the entries handed over; the last bucket's load (``flush_cache``) can be made
    slow and its reply time recorded."""

    def __init__(self, inner, slow_last=False):
        self.inner, self.slow_last = inner, slow_last
        self.creators, self.handed, self.last_reply = [], 0, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def update_weights_from_tensor(self, payloads, engines=None, load_format="flattened_bucket", flush_cache=False):
        self.creators.append({e: [int(re.search(rb"/torch_(\d+)_", p).group(1)) for p in row]
                              for e, row in zip(engines, payloads)})
        self.handed += sum(len(row) for row in payloads)
        return ("deferred", payloads, list(engines), load_format, flush_cache, list(self.inner.restarts))

    def wait(self, pending, what="call"):
        if not (isinstance(pending, tuple) and pending[:1] == ("deferred",)):
            return self.inner.wait(pending, what)
        _, payloads, engines, load_format, flush_cache, restarts = pending
        time.sleep(LOAD_DELAY_S)
        alive = [k for k, e in enumerate(engines) if self.inner.restarts[e] == restarts[e]]  # a call to a dead engine
        try:
            return self.inner.wait(self.inner.update_weights_from_tensor(
                [payloads[k] for k in alive], engines=[engines[k] for k in alive], load_format=load_format,
                flush_cache=flush_cache), what)
        finally:
            if flush_cache and self.slow_last:
                time.sleep(SLOW_LAST_REPLY_S)
                self.last_reply = time.monotonic()


class Counters:
    """Every rank: serialized bucket handles (SGLang's MultiprocessingSerializer) and the times the bridge freed
    its pool."""

    def __init__(self):
        from sglang.srt.utils.common import MultiprocessingSerializer

        from rlhf.weight_bridge import bridge

        self.serialized, self.freed, self.groups = 0, [], 0
        serialize, free, new_group = (MultiprocessingSerializer.serialize, bridge.WeightBridge._free_pool,
                                      dist.new_group)
        self._restore = lambda: (setattr(MultiprocessingSerializer, "serialize", staticmethod(serialize)),  # noqa: E731
                                 setattr(bridge.WeightBridge, "_free_pool", free),
                                 setattr(dist, "new_group", new_group))

        def counting_group(*args, **kwargs):
            self.groups += 1
            return new_group(*args, **kwargs)

        def counting(obj, output_str=False):
            self.serialized += 1
            return serialize(obj, output_str)

        def timed_free(this):
            self.freed.append(time.monotonic())
            return free(this)

        MultiprocessingSerializer.serialize = staticmethod(counting)
        bridge.WeightBridge._free_pool = timed_free
        dist.new_group = counting_group

    def reset(self):
        self.serialized, self.freed, self.groups = 0, [], 0

    def restore(self):
        self._restore()


def sync(actor, fleet, tag):
    """One sync of a fresh bridge; returns its stats or the error text."""
    from rlhf.weight_bridge import WeightBridge, WeightBridgeError, WeightSyncConfig

    bridge = WeightBridge(actor.chunks, actor.spec, fleet, WeightSyncConfig(bucket_bytes=64 * 1024, group_prefix=tag))
    try:
        return bridge.sync()
    except WeightBridgeError as e:
        return str(e)
    finally:
        bridge.close()


def fault_sync(actor, fleet, tag, rank, name):
    """``sync`` with the fault point ``sync_convert_error`` armed on global ``rank`` (its 3rd conversion raises),
    under a watchdog: a rank still in the sync after WATCHDOG_S prints the CHECK line as FAIL and exits."""
    from tests.support.fault_watchdog import armed_under_watchdog

    with armed_under_watchdog("sync_convert_error@3", rank, name, WATCHDOG_S):
        return sync(actor, fleet, tag)


def run_layout(tp, pp, ep, n, etp, path, counters):
    from transformers import AutoConfig

    from megatron.core import parallel_state as ps

    from parallel.models import build_model_chunks
    from rlhf.rollout.placement import stage_leaders
    from tests.support.fakes import FakeEngines, expected_weights_from_spec

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(tp=tp, pp=pp, ep=ep)
    set_seed(1234)
    rank0, world = dist.get_rank() == 0, dist.get_world_size()
    lay = f"holders_{layout_name(tp, pp, ep, n, etp)}"
    actor = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    expected = (expected_weights_from_spec(actor.spec) if ep == 1 else  # the MoE's own checkpoint names and shapes
                {k: (tuple(v.shape), v.dtype) for k, v in load_checkpoint(path).items()})

    def fleet(**kw):
        return Fleet(FakeEngines(expected, n=n, tp_size=etp, **kw.pop("engines", {})), **kw) if rank0 else None

    def gathered(value):
        out = [None] * world
        dist.all_gather_object(out, value)
        return out

    # who created each entry's memory, what each engine rank loaded
    counters.reset()
    f = fleet(slow_last=True)
    stats = sync(actor, f, lay)
    freed = gathered(counters.freed)
    groups = gathered(counters.groups)
    ok, detail = False, ""
    if rank0:
        want = {e: [pids[e * etp + r] for r in range(etp)] for e in range(n)}
        calls = f.creators
        ok = bool(calls) and all(call == want for call in calls)
        detail = (f"trainer pids {pids}; want {want}; per bucket: {calls[:1]} .. {calls[-1:]} ({len(calls)} "
                  f"buckets)")
    report(f"{lay}_entry_from_rank_on_its_device", ok, detail)
    if ep > 1:
        from rlhf.rollout.placement import job_placement_problem

        why = job_placement_problem(mode="colocated", num_engines=n, engine_tp=etp, gpus_per_node=2, nnodes=2,
                                    trainer_world_size=world)
        node_of = {pid: r // 2 for r, pid in enumerate(pids)}
        away = [(e, r, pid) for call in (f.creators if rank0 else []) for e, row in call.items()
                for r, pid in enumerate(row) if node_of[pid] != (e * etp + r) // 2]
        report(f"{lay}_placed_on_two_nodes", rank0 and why is None and bool(f.creators) and not away,
               f"placement on 2 nodes x 2 GPUs: {why or 'places'}; stage leaders {stage_leaders(world, pp)}; "
               f"entries from another node (engine, rank, pid): {away[:4]}")
    if rank0:
        ckpt = load_checkpoint(path)
        got = [e.by_rank for e in f.inner.engines]
        bad = [(e, r, x) for e in range(n) for r in range(etp) for x in expected
               if x not in got[e][r] or not torch.equal(got[e][r][x], ckpt[x].to(got[e][r][x].dtype))]
        ok = not bad and not isinstance(stats, str) and set(expected) <= set(ckpt)
        detail = f"{n} engines x {etp} ranks x {len(expected)} tensors compared; differing or missing: {bad[:4]}"
    report(f"{lay}_entries_bitwise_equal_checkpoint", ok, detail)
    reply = gathered(f.last_reply if rank0 else None)[0]
    early = {r: round(min(t) - reply, 3) if t else "never" for r, t in enumerate(freed)
             if reply is not None and (not t or min(t) < reply)}
    report(f"{lay}_pools_freed_after_the_engines_last_reply", reply is not None and not early,
           f"ranks freeing before the last reply (seconds after it): {early}; frees per rank: "
           f"{[len(t) for t in freed]}")
    report(f"{lay}_broadcast_on_an_existing_group", not any(groups) and not isinstance(stats, str),
           f"new_group calls per rank in a sync with holders: {groups}")

    # a production error mid-stage on the last stage's leader (under EP also on stage 0's expert peer of TP rank 0,
    # rank tp, a holder converting its routed experts): every rank raises, nothing left in a collective
    for check, rank in (("production_error", stage_leaders(world, pp)[-1]), ("expert_peer_error", tp))[:1 + (ep > 1)]:
        name = f"{lay}_{check}_raises_on_every_rank"
        got = fault_sync(actor, fleet(), f"{lay}_{check}", rank, name)
        raised = gathered(isinstance(got, str) and "FAULT sync_convert_error" in got)
        again = gathered(not isinstance(sync(actor, fleet(), f"{lay}_after_{check}"), str))
        report(name, all(raised) and all(again), f"fault on rank {rank}; raised naming it on ranks {raised}; the "
               f"next sync fine on ranks {again}: {str(got)[:200]}")

    # a failed sync and a replaced engine: nothing serialized that is not handed to an engine
    for name, engines in (("failed_sync", {"fail_at": {(0, 1)}}), ("replaced_engine", {"kill_at": {(n - 1, 1)}})):
        counters.reset()
        f = fleet(engines=engines)
        got = sync(actor, f, f"{lay}_{name}")
        serialized = sum(gathered(counters.serialized))
        raised = gathered(isinstance(got, str))
        handed = f.handed if rank0 else 0
        ok, detail = False, ""
        if rank0:
            if name == "failed_sync":
                ok = all(raised) and serialized == handed and handed > 0
                what = f"raised on ranks {raised}: {str(got)[:160]}"
            else:
                reached = None if isinstance(got, str) else got.engines
                ok = not any(raised) and serialized == handed and reached == list(range(n - 1))
                what = f"engines reached {reached} (engine {n - 1} replaced at its call 1)"
            detail = f"serialized on all ranks {serialized}, handed to the engines {handed}; {what}"
        report(f"{lay}_{name}_serializes_only_what_is_delivered", ok, detail)
    dist.barrier()


def load_checkpoint(path):
    from safetensors.torch import load_file

    return {k: v for name in sorted(os.listdir(path)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, name)).items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    init_distributed()
    from tests.support.model_families import make_family_model
    from tests.support.tiny_models import make_tiny_hf_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, "llama")
    if dist.get_rank() == 0:
        tok = make_tiny_tokenizer()
        make_tiny_hf_model(path, "llama_gqa", vocab_size=len(tok), hidden_size=64, num_layers=4, seed=7, tokenizer=tok)
        make_family_model(path + "_moe", "qwen3_moe", num_layers=4, seed=7)
    dist.barrier()
    counters = Counters()
    try:
        for lay in LAYOUTS:
            try:
                run_layout(*lay, path + ("_moe" if lay[2] > 1 else ""), counters)
            except Exception:
                traceback.print_exc()
                print(f"CHECK holders_{layout_name(*lay)}_completed FAIL rank {dist.get_rank()}", flush=True)
                raise
    finally:
        counters.restore()  # the launch may run other scripts in these processes
    dist.barrier()


if __name__ == "__main__":
    main()
