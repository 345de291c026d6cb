"""Two terms of the memory plan, by hand: the weight sync's largest tensor (a bucket of its own outside the pool) and
the NCCL communicators each trainer process creates (one per process group it uses, NVIDIA/nccl#964's figures)."""
import pytest

from rlhf.memory_plan.from_config import plan_from_config, plan_input_from_config
from rlhf.memory_plan.planner import EngineSetup, Layout, communicators, plan_memory
from rlhf.memory_plan.terms import (NCCL_COMM_BYTES, NCCL_PAIR_COMM_BYTES, nccl_communicators, oversize_sync_bytes,
                                    sync_broadcast_groups)
from tests.unit.memory_plan.test_memory_plan import QWEN2_7B, small_input

MiB = 1 << 20
BIG = ("weight sync: the embedding / LM head, a bucket of its own outside the pool (its TP peers' rows received + "
       "the bucket)")


def _sync_items(plan):
    return {i.name: i.bytes for i in plan.phase("weight sync").items}


@pytest.mark.parametrize("tp,weight_bytes,leader,holder", [
    # TP2: rank 1's rows (1000 - 1024 / 2 = 488 x 64 x 2 B = 62464) go to the receive buffer, which the plan's
    # "gathered + packed" item allows 100000 (one bucket), then the bucket itself (1000 x 64 x 2 = 128000): no
    # concatenation (torch.cat) any more
    (2, 2, 100000 + 128000 - 100000, 128000),
    # TP1: no receive buffer: the item's 100000 hold part of the bucket
    (1, 2, 128000 - 100000, 128000),
    # an fp32 engine: the bf16 rows are cast straight into the fp32 bucket (1000 x 64 x 4 = 256000), no cast copy
    (2, 4, 100000 + 256000 - 100000, 256000),
])
def test_largest_tensor_of_the_weight_sync_by_hand(tp, weight_bytes, leader, holder):
    """SMALL's embedding (1000 x 64 in bf16 = 128000 B) does not fit a pool buffer (bucket 100000 B / 2): a bucket
    of its own, outside the pool, on the stage leader's GPU and as one copy on every holder's GPU."""
    layout = Layout(tp=tp, pp=1, dp=4 // tp)
    eng = EngineSetup(tp=2, num_engines=2, mem_fraction_static=0.5, runtime_bytes=1 << 20, sync_bucket_bytes=100000,
                      weight_bytes=weight_bytes)
    plan = plan_memory(small_input(layout=layout, engine=eng))
    items = _sync_items(plan)
    assert items["weight sync buckets on the stage leader's GPU (gathered + packed)"] == 200000
    assert items[BIG] == leader
    assert plan.sync_copy_bytes == 100000 + holder
    # a bucket that holds the embedding: no extra term (tests/unit/memory_plan/test_memory_plan.py, 1 MiB)
    assert oversize_sync_bytes(vocab=1000, hidden=64, tp=tp, divisible_by=128, params_bytes=2,
                               weight_bytes=weight_bytes, bucket_bytes=2 * 1000 * 64 * weight_bytes) == (0.0, 0.0)


def test_qwen2_7b_weight_sync_counts_the_embedding():
    """gsm8k_ppo_qwen2_7b (TP4, 512 MiB buckets): the embedding / LM head is 152064 x 3584 bf16 = 1.015 GiB (no
    vocabulary padding at TP4); on the leader ranks 1-3's rows (114048 x 3584 bf16 = 0.76 GiB, more than the item's
    512 MiB receive buffer) and the bucket (the plan had 1 GiB for the whole sync); every other engine GPU holds the
    pool and one copy of it."""
    from rlhf.config import compose_config

    plan = plan_from_config(compose_config([], recipe="gsm8k_ppo_qwen2_7b"), QWEN2_7B, world_size=8)
    x = 152064 * 3584 * 2
    assert _sync_items(plan)[BIG] == 114048 * 3584 * 2 + x - 512 * MiB
    assert plan.sync_copy_bytes == 512 * MiB + x


def test_nccl_communicators_by_hand():
    """Per trainer process: one communicator per process group it uses (megatron-core makes the DP group with and
    without CP separately; unbatched pipeline p2p gets one two-rank communicator per neighbour)."""
    def sizes(**kw):
        return [(c.name, c.ranks, c.at_start) for c in nccl_communicators(**kw)]

    # the 7B recipes: TP4 x DP2 on 8 GPUs, distributed optimizer everywhere
    assert sizes(tp=4, pp=1, dp=2) == [("world", 8, True), ("tensor parallel", 4, False),
                                       ("data parallel x context parallel", 2, False), ("data parallel", 2, False),
                                       ("gradient norm (distributed optimizer)", 8, False)]
    # TP2 x PP4 interleaved, tied embeddings, a role without the distributed optimizer: stage 0 has both ring
    # neighbours and the tied-embedding pair, stage 1 neither the pair; without interleaving stage 0 has one peer
    stage0 = sizes(tp=2, pp=4, dp=1, vpp=2, stage=0, tied=True, other_optimizer=True)
    assert stage0 == [("world", 8, True), ("tensor parallel", 2, False), ("pipeline parallel", 4, False),
                      ("pipeline send/recv pair", 2, False), ("pipeline send/recv pair", 2, False),
                      ("tied embedding", 2, False), ("gradient norm (distributed optimizer)", 8, False),
                      ("gradient norm (model parallel)", 8, False)]
    assert [n for n, _, _ in sizes(tp=2, pp=4, dp=1, vpp=2, stage=1, tied=True)].count("tied embedding") == 0
    assert [n for n, _, _ in sizes(tp=2, pp=4, dp=1, stage=0)].count("pipeline send/recv pair") == 1
    assert [n for n, _, _ in sizes(tp=2, pp=4, dp=1, stage=1)].count("pipeline send/recv pair") == 2
    # the weight sync's groups and a disaggregated leader's group with 4 engines of TP2
    assert sizes(tp=1, pp=1, dp=2, sync_groups=(3,), engine_group=9)[-2:] == [
        ("weight sync broadcast", 3, False), ("weight update with the engines", 9, False)]


def test_plan_counts_each_communicator_once_at_its_size():
    """small_input (50 MiB per communicator of > 2 ranks, 40 MiB per pair) at TP1 x DP4 with one engine of TP2:
    the holders are ranks 0 and 1 (neither every rank nor a TP group): the weight sync adds a two-rank group."""
    plan = plan_memory(small_input(layout=Layout(tp=1, pp=1, dp=4),
                                   engine=EngineSetup(tp=2, num_engines=1, runtime_bytes=1 << 20,
                                                      sync_bucket_bytes=1 << 20)))
    nccl = lambda phase: [i.bytes for i in plan.phase(phase).items if i.name.startswith("NCCL")]  # noqa: E731
    assert nccl("build") == nccl("engine start") == [50 * MiB]  # the world's
    # world, DP x CP 4, DP 4, grad norm 4 (distributed optimizer) + the weight sync's pair
    assert nccl("generate") == nccl("weight sync") == nccl("actor fwd/bwd") == [4 * 50 * MiB + 40 * MiB]
    inp = plan_input_from_config({"parallel": {"tensor_model_parallel_size": 4}, "data": {
        "max_prompt_length": 8, "max_response_length": 8}, "rollout": {"num_engines": 4,
                                                                       "tensor_model_parallel_size": 2}},
                                 QWEN2_7B, world_size=8)
    assert inp.nccl_comm_bytes == NCCL_COMM_BYTES == 688 * MiB and inp.nccl_pair_comm_bytes == 544 * MiB
    assert [c.ranks for c in communicators(inp)] == [8, 4, 2, 2, 4]  # (no distributed optimizer: grad norm tp x pp)
    assert NCCL_PAIR_COMM_BYTES == 544 * MiB


@pytest.mark.parametrize("world,pp,tp,engines,etp", [
    (8, 1, 4, 4, 2), (8, 1, 2, 2, 2), (8, 1, 4, 2, 2), (8, 2, 2, 2, 2), (8, 2, 2, 4, 2), (4, 2, 1, 1, 4),
    (4, 1, 2, 1, 2), (16, 4, 2, 8, 2), (8, 4, 1, 3, 2)])
def test_sync_groups_mirror_the_bridges_holders(world, pp, tp, engines, etp):
    """terms.sync_broadcast_groups on plain numbers = what the bridge makes: per stage the leader and the holders
    (placement.holder_ranks, placement.stage_leaders), one new group per member set that is neither every rank
    nor one of megatron's TP groups (local_handles.broadcast_group reuses those)."""
    from rlhf.rollout.placement import stage_leaders
    from rlhf.rollout.placement import holder_ranks

    tp_groups = {tuple(range(k, k + tp)) for k in range(0, world, tp)}
    sets = set()
    for leader in stage_leaders(world, pp):
        held = holder_ranks(engines, etp, world, leader)
        if any(r != leader for r in held.values()):
            members = tuple(sorted({leader, *held.values()}))
            if members != tuple(range(world)) and members not in tp_groups:
                sets.add(members)
    assert sync_broadcast_groups(world, pp, tp, engines, etp) == tuple(len(m) for m in sorted(sets))
