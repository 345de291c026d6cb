"""A production error on the stage leader mid-stage (rlhf/weight_bridge/hf_stream.py): the leader keeps taking part
in the TP gathers its peers issue for every entry, the sync raises on the controller, nothing more is delivered.
Single process (tests/support/fakes.SimulatedTPTopology counts the leader's gathers); the multi-rank form, where a
missing gather hangs the peers, is tests/support/dist/holder_checks.py (``*_production_error_*``)."""
from __future__ import annotations

import pytest
import torch

from parallel.convert import GATHER_DIM
from rlhf import faults
from rlhf.weight_bridge import WeightBridge, WeightBridgeError, WeightSyncConfig
from rlhf.weight_bridge.bucketing import BufferPool, MemoryMeter
from rlhf.weight_bridge.hf_stream import stage_buckets
from rlhf.weight_bridge.plan import plan_local_tensors, sync_entries
from tests.support.fakes import FakeEngines, SimulatedTPTopology, expected_weights_from_spec
from tests.unit.weight_bridge.test_weight_bridge_layout import make_spec, random_hf_state, simulated_trainer


class CountingTopology(SimulatedTPTopology):
    """Counts the gathers the leader issues (its TP peers issue one per entry that has a gather dimension)."""

    def __init__(self, rank_chunks):
        super().__init__(rank_chunks)
        self.gathers = 0

    def gather(self, entry, pool=None, spec=None):
        self.gathers += 1
        return super().gather(entry, pool, spec)


@pytest.fixture
def fault(monkeypatch):
    def arm(spec):
        monkeypatch.setenv("RLHF_FAULT", spec)
        monkeypatch.setattr(faults, "_hits", {})
    return arm


def _trainer():
    spec = make_spec(8, 4, False, True)
    return spec, simulated_trainer(random_hf_state(spec, seed=5), spec, 2)


def _peer_gathers(entries):
    return sum(GATHER_DIM[e.role.kind] is not None for e in entries)


@pytest.mark.parametrize("overlap", [False, True])
def test_leader_gathers_every_entry_after_a_conversion_error(fault, overlap):
    """The 3rd conversion raises (fault point ``sync_convert_error``): the leader still issues one gather per
    entry (what its peers issue), the sync raises WeightBridgeError naming the fault, and the engine got only
    the buckets completed before it."""
    spec, ranks = _trainer()
    topo = CountingTopology(ranks)
    engines = FakeEngines(expected_weights_from_spec(spec))
    bridge = WeightBridge(ranks[0], spec, engines, WeightSyncConfig(bucket_bytes=4096, overlap=overlap), topology=topo)
    plan = bridge.plan()
    entries, _ = sync_entries(bridge.chunks, spec, None, topo)
    fault("sync_convert_error@3")
    topo.gathers = 0
    with pytest.raises(WeightBridgeError, match="FAULT sync_convert_error"):
        bridge.sync()
    assert topo.gathers == _peer_gathers(entries) > 3
    delivered = [n for call, names in engines.engines[0].calls if call == "update_weights_from_tensor" for n in names]
    assert len(delivered) < plan.num_tensors


def test_packing_error_yields_every_bucket_after_the_gathers_of_its_tensors():
    """A packing error (the pool cannot allocate bucket 1's buffer, as a CUDA OOM would) ends the packing, not
    the gathers: ``stage_buckets`` still yields one item per planned bucket, ``(plan, None, error)`` from
    bucket 1 on, each right after the gathers of the entries its tensors come from, and every entry is gathered."""
    spec, ranks = _trainer()
    topo = CountingTopology(ranks)
    plans = WeightBridge(ranks[0], spec, FakeEngines(expected_weights_from_spec(spec)),
                         WeightSyncConfig(bucket_bytes=4096), topology=topo).plan().stages[0].buckets
    entries, _ = sync_entries(ranks[0], spec, None, topo)
    counts = [len(plan_local_tensors([e], spec, 2)) for e in entries]
    gathering = [GATHER_DIM[e.role.kind] is not None for e in entries]
    assert len(plans) > 3

    class FailingPool(BufferPool):
        calls = 0

        def acquire(self, nbytes):
            FailingPool.calls += 1
            if FailingPool.calls == 2:
                raise torch.cuda.OutOfMemoryError("no memory for bucket 1")
            return super().acquire(nbytes)

    pool = FailingPool(max(p.nbytes for p in plans), count=2)
    topo.gathers, seen, after = 0, [], []
    for k, (bplan, slot, buf) in enumerate(stage_buckets(entries, plans, topo, spec, pool, MemoryMeter(), False,
                                                         {"produce": 0.0})):
        assert bplan is plans[k]
        seen.append((slot is None, type(buf).__name__))
        done = sum(len(p.metas) for p in plans[:k + 1])  # HF tensors through bucket k
        need = next(i for i in range(len(counts) + 1) if sum(counts[:i]) >= done)  # entries they come from
        after.append((topo.gathers, sum(gathering[:need])))
        pool.release(slot)
    assert seen[0] == (False, "Tensor") and all(s == (True, "OutOfMemoryError") for s in seen[1:]), seen
    assert all(got == want for got, want in after), after  # bucket k right after the gathers it needs
    assert topo.gathers == sum(gathering)


def test_a_conversion_error_keeps_no_gathered_shards_alive(monkeypatch):
    """The stored error holds no frame of the failed conversion: its gathered shards are freed at once (on GPU the
    leader's next gathers need that memory back after an OOM; before, the traceback kept them alive until the sync
    ended).  The traceback stays readable as a note."""
    import gc
    import weakref

    import rlhf.weight_bridge.hf_stream as hs

    def oom(role, shards, spec):
        if shards[0].device.type != "meta":
            raise RuntimeError("CUDA out of memory (simulated)")
        return [("model.embed_tokens.weight", shards[0])]

    monkeypatch.setattr(hs, "hf_tensors_from_shards", oom)
    monkeypatch.setattr(hs, "hf_parts_from_shards", oom)
    spec, ranks = _trainer()
    entry = next(e for e in sync_entries(ranks[0], spec, None, SimulatedTPTopology(ranks))[0])
    shards = [torch.zeros(64, 8), torch.zeros(64, 8)]
    alive = weakref.ref(shards[0])
    state = hs.Production()
    out = hs._convert(entry, shards, spec, state)
    del shards
    gc.collect()
    assert alive() is None, "the error's traceback keeps the gathered shards alive"
    assert out[0][1] is state.error and "simulated" in str(state.error)
    assert "in oom" in "".join(state.error.__notes__)

