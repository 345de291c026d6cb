"""WeightBridge with ``lora`` (adapters synced as adapters), one process, FakeEngines: when the (unmerged) base goes
and when only the adapters do, what ``bytes`` counts, and the base state after an error.  The full sync (``_sync``)
is recorded, not run: its own path is tested elsewhere; here the adapter tensors are two hand-made PEFT tensors."""
import pytest
import torch

import parallel.lora_export as lora_export
from parallel.lora import LoRASettings
from rlhf.weight_bridge import SyncStats, WeightBridge, WeightBridgeError, WeightSyncConfig
from tests.support.fakes import FakeEngines, SimulatedTPTopology

ADAPTER = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, 16),
           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 8)}
ADAPTER_BYTES = (8 * 16 + 32 * 8) * 4
FULL_BYTES = 1000


@pytest.fixture
def bridge(monkeypatch):
    monkeypatch.setattr(lora_export, "peft_adapter_tensors", lambda chunks, spec: dict(ADAPTER))
    engines = FakeEngines({}, n=2)
    b = WeightBridge([], None, engines, WeightSyncConfig(lora=LoRASettings(rank=8, alpha=16.0)),
                     topology=SimulatedTPTopology([[]]))
    b.full_syncs = []

    def full(targets):
        b.full_syncs.append(targets)
        engines.log.append(("base", targets))
        if getattr(b, "fail_full", False):
            raise WeightBridgeError("weight sync failed: injected")
        return SyncStats(bytes=FULL_BYTES, num_tensors=3, engines=[0, 1] if targets is None else list(targets))

    monkeypatch.setattr(b, "_sync", full)
    return b, engines


def test_base_once_then_adapters_only(bridge):
    b, engines = bridge
    first = b.sync()  # the engines may lack the base (not told otherwise): base, then adapters
    assert b.full_syncs == [None] and first.bytes == FULL_BYTES + ADAPTER_BYTES and first.num_tensors == 5
    assert b.base_sent
    second = b.sync()
    assert b.full_syncs == [None] and second.bytes == ADAPTER_BYTES and second.num_tensors == 2
    assert second.metrics()["weight_sync/bytes"] == ADAPTER_BYTES
    for e in engines.engines:
        tensors, config = e.adapter
        assert sorted(tensors) == sorted(ADAPTER) and (config["r"], config["lora_alpha"]) == (8, 16.0)
        assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                            "v_proj"]


def test_replaced_engines_get_the_base_again_the_others_do_not(bridge):
    b, engines = bridge
    b.base_sent = True  # the engines started from the base weights (RolloutWorker)
    assert b.sync().bytes == ADAPTER_BYTES and b.full_syncs == []
    engines.engines[1].adapter = None
    stats = b.sync(engines=[1])
    assert b.full_syncs == [[1]] and stats.bytes == FULL_BYTES + ADAPTER_BYTES and stats.engines == [1]
    assert engines.engines[1].adapter is not None and b.base_sent
    assert b.sync().bytes == ADAPTER_BYTES and b.full_syncs == [[1]]


def test_a_failed_base_sync_sends_the_base_again_and_a_refused_adapter_raises(bridge):
    b, engines = bridge
    b.base_sent, b.fail_full = True, True
    with pytest.raises(WeightBridgeError, match="injected"):
        b.sync(engines=[0])
    assert not b.base_sent  # engine 0's base may be half written: the next sync sends it to all
    b.fail_full = False
    assert b.sync().bytes == FULL_BYTES + ADAPTER_BYTES and b.full_syncs == [[0], None] and b.base_sent
    engines.fail_lora = True
    with pytest.raises(WeightBridgeError, match="LoRA adapter sync failed: RuntimeError: load_lora_adapter_from"):
        b.sync()
    assert b.base_sent  # the base is intact: the next sync sends the adapters only


def test_a_plain_sync_sends_the_base_first_to_an_engine_replaced_since(bridge):
    """An engine replaced after a crash serves model.path's base (not the actor's when it started from a megatron
    checkpoint): a sync of all engines (RolloutWorker.sync_weights) sends it the base before the adapters; a
    plain adapter sync would mark it fresh (end_sync) and the stale-engine re-sync would never see it."""
    b, engines = bridge
    b.base_sent = True
    b.sync()
    engines.engines[1].adapter, engines.restarts[1] = None, engines.restarts[1] + 1  # as the manager's restart
    engines.stale.add(1)
    engines.log.clear()
    stats = b.sync()
    assert b.full_syncs == [[1]], "the replaced engine must receive the base"
    assert engines.log == [("base", [1]), "load_lora_adapter", "load_lora_adapter"]  # base first, then adapters
    assert stats.bytes == FULL_BYTES + ADAPTER_BYTES and stats.engines == [0, 1] and b.base_sent
    assert engines.stale_engines() == [] and engines.engines[1].adapter is not None
    assert b.sync().bytes == ADAPTER_BYTES and b.full_syncs == [[1]]  # the base went: adapters only again
