"""Which Ray node each rollout engine goes to in a multi-node job (rlhf/rollout/placement.py): trainer ranks
matched to Ray nodes, GPU plan nodes pinned to them, CPU engines (disaggregated) away from trainer rank 0's
node; values written by hand on fake ``ray.nodes()`` lists."""
import pytest

from parallel.distributed import node_label
from rlhf.rollout.placement import (PlacementError, cpu_engine_nodes, describe_engine_nodes, engine_actor_options,
                                    gpu_engine_nodes, plan_placement, rank_ray_nodes)


def hx(short: str) -> str:
    """A valid 28-byte Ray node id made from a short name (NodeAffinitySchedulingStrategy checks the format)."""
    return (short.encode().hex() * 56)[:56]


def node(nid, name, host="h", ip="127.0.0.1", gpus=0, alive=True):
    return {"NodeID": nid, "NodeName": name, "NodeManagerHostname": host, "NodeManagerAddress": ip, "Alive": alive,
            "Resources": {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}}


# two Ray nodes on one host (tests/support/ray_cluster_local.py, tests/support/slurm_local.py): told apart by name only
LOOPBACK = [node("id1", "n1"), node("id2", "n2"), node("id3", "n3", alive=False)]


def test_ranks_matched_by_name_then_host_then_ip():
    labels = [("n1", "h", "127.0.0.1"), ("n2", "h", "127.0.0.1")]
    assert rank_ray_nodes(labels, LOOPBACK, "id1", 2) == ["id1", "id2"]
    cluster = [node("a", "10.0.0.1", host="gpu1", ip="10.0.0.1"), node("b", "10.0.0.2", host="gpu2", ip="10.0.0.2")]
    assert rank_ray_nodes([("gpu1", "gpu1", "x"), ("gpu2", "gpu2", "x")], cluster, "a", 2) == ["a", "b"]  # host
    assert rank_ray_nodes([("x", "x", "10.0.0.1"), ("y", "y", "10.0.0.2")], cluster, "a", 2) == ["a", "b"]  # ip
    # a label matching several nodes (same host, no name) is unknown; rank 0 is then the driver's node
    assert rank_ray_nodes([("h", "h", "127.0.0.1")] * 2, LOOPBACK, "id2", 2) == ["id2", None]
    assert rank_ray_nodes(None, LOOPBACK, "id1", 3) == ["id1", None, None]
    assert rank_ray_nodes(None, [node("only", "n1")], "only", 2) == ["only", "only"]  # one-node cluster


def test_cpu_disaggregated_engines_avoid_rank0s_node():
    assert cpu_engine_nodes(["id1", "id2"], LOOPBACK, "disaggregated") == ["id2"]
    assert cpu_engine_nodes(["id2", "id1"], LOOPBACK, "disaggregated") == ["id1"]
    three = LOOPBACK[:2] + [node("id3", "n3")]
    # nodes without trainer ranks first, then the other trainer nodes, by name
    assert cpu_engine_nodes(["id1", "id2"], three, "disaggregated") == ["id3", "id2"]
    assert cpu_engine_nodes(["id1", "id1"], three, "disaggregated") == ["id2", "id3"]
    # colocated: each engine on the node of the trainer rank that serves it (engine i, TP rank 0: rank i * tp)
    assert cpu_engine_nodes(["id1", "id2"], three, "colocated") == ["id1"]
    assert cpu_engine_nodes(["id1", "id2"], three, "colocated", num_engines=2) == ["id1", "id2"]
    assert cpu_engine_nodes(["id1", "id1", "id2", "id2"], three, "colocated", 2, 2) == ["id1", "id2"]
    assert cpu_engine_nodes(["id1", "id2"], three, "colocated", 3) == ["id1", "id2", "id1"]  # past the ranks: rank 0's
    assert cpu_engine_nodes(["id1"], [node("id1", "n1")], "disaggregated") is None  # one node: anywhere


def test_cpu_engine_actor_options_pin_each_engine():
    opts = [engine_actor_options(i, env={}, node_ids=[hx("id2"), hx("id3")]) for i in range(3)]
    assert [o["scheduling_strategy"].node_id for o in opts] == [hx("id2"), hx("id3"), hx("id2")]
    assert all(o["scheduling_strategy"].soft is False and o["num_gpus"] == 0 for o in opts)
    assert "scheduling_strategy" not in engine_actor_options(0, env={}, node_ids=None)
    names = describe_engine_nodes(3, ["id2", "id1"], LOOPBACK)
    assert names == "engine 0 on Ray node n2, engine 1 on Ray node n1, engine 2 on Ray node n2"


def test_gpu_plan_nodes_follow_the_trainer_ranks():
    cluster = [node("a", "g1", gpus=4), node("b", "g2", gpus=4), node("c", "g3", gpus=4), node("d", "cpu")]
    ranks = ["b"] * 4 + ["a"] * 4  # rank 0 on g2: plan node 0 is g2
    assert gpu_engine_nodes(ranks, 4, cluster, "colocated") == (2, ["b", "a"])
    nnodes, ids = gpu_engine_nodes(ranks, 4, cluster, "disaggregated")
    assert (nnodes, ids) == (3, ["b", "a", "c"])          # engines on the GPU node without trainer ranks
    plan = plan_placement(nnodes=nnodes, gpus_per_node=4, trainer_world_size=8, num_engines=2, engine_tp=2,
                          mode="disaggregated")
    assert [ids[plan.engine_node(i)] for i in range(2)] == ["c", "c"] and plan.base_gpu_id(1) == 2
    hex_ids = [hx(i) for i in ids]
    assert engine_actor_options(1, env={}, plan=plan, node_ids=hex_ids)["scheduling_strategy"].node_id == hx("c")
    # trainer on one node, engines on the same node's free GPUs
    assert gpu_engine_nodes(["a"] * 3, 4, cluster, "disaggregated")[1][:1] == ["a"]


@pytest.mark.parametrize("ranks,match", [
    (["a", "a", "b", "b"], r"ranks 0-3 should share plan node 0"),           # not laid out in rank order
    (["a", "a", "a", "a", "a", None, "a", "a"], r"ranks 4-7 .*rank 5: not a Ray node"),
    (["a"] * 8, r"ranks 4-7 should share plan node 1"),                     # second node not in the Ray cluster
])
def test_gpu_bad_rank_layouts_are_refused(ranks, match):
    cluster = [node("a", "g1", gpus=4), node("b", "g2", gpus=4)]
    with pytest.raises(PlacementError, match=match):
        gpu_engine_nodes(ranks, 4, cluster, "colocated")


def test_node_label():
    name, host, ip = node_label({"RLHF_NODE_NAME": "n2", "SLURMD_NODENAME": "x", "MASTER_ADDR": "127.0.0.1"})
    assert (name, ip) == ("n2", "127.0.0.1") and host
    assert node_label({"SLURMD_NODENAME": "x"})[0] == "x"
    assert node_label({})[0] == node_label({})[1]  # the host name
