"""Engine / trainer GPU placement (rlhf.rollout.placement): a pure function, values written by hand."""
import pytest

from rlhf.rollout.placement import (GPU, PlacementError, engine_actor_options, job_placement_problem, plan_placement,
                                    stage_leaders)


def gpus(node, *idx):
    return [GPU(node, i) for i in idx]


@pytest.mark.parametrize("tp,n,expected", [
    (1, 8, [gpus(0, i) for i in range(8)]),
    (2, 4, [gpus(0, 0, 1), gpus(0, 2, 3), gpus(0, 4, 5), gpus(0, 6, 7)]),
    (4, 2, [gpus(0, 0, 1, 2, 3), gpus(0, 4, 5, 6, 7)]),
    (2, 2, [gpus(0, 0, 1), gpus(0, 2, 3)]),  # fewer engines than trainer GPUs: the first ones
])
def test_colocated_one_node(tp, n, expected):
    plan = plan_placement(nnodes=1, gpus_per_node=8, trainer_world_size=8, num_engines=n, engine_tp=tp, mode="colocated")
    assert plan.trainer == gpus(0, *range(8))
    assert plan.engines == expected
    assert [plan.base_gpu_id(i) for i in range(n)] == [e[0].index for e in expected]


def test_colocated_engines_on_every_node():
    """verl's replica layout: engines on the trainer's GPUs of every node (each engine rank maps memory of the trainer
    rank on its own GPU, which receives every bucket by the trainer's broadcast: rlhf/weight_bridge/from_tensor.py);
    before, every engine had to be on rank 0's node and 4 x 8 GPUs at TP2 placed 4 engines instead of 16."""
    plan = plan_placement(nnodes=2, gpus_per_node=4, trainer_world_size=8, num_engines=4, engine_tp=2, mode="colocated")
    assert plan.trainer[5] == GPU(1, 1)
    assert plan.engines == [gpus(0, 0, 1), gpus(0, 2, 3), gpus(1, 0, 1), gpus(1, 2, 3)]
    assert [plan.engine_node(i) for i in range(4)] == [0, 0, 1, 1]
    guide = plan_placement(nnodes=4, gpus_per_node=8, trainer_world_size=32, num_engines=16, engine_tp=2,
                           mode="colocated")
    assert [guide.engine_node(i) for i in range(16)] == [n for n in range(4) for _ in range(4)]
    assert job_placement_problem(mode="colocated", num_engines=16, engine_tp=2, gpus_per_node=8, nnodes=4) is None


@pytest.mark.parametrize("nnodes,per_node,engines,tp,most", [
    (2, 4, 5, 2, 4),    # 10 GPUs of engines on the trainer's 8
    (2, 8, 9, 2, 8),
])
def test_colocated_engines_beyond_the_trainers_gpus_are_refused(nnodes, per_node, engines, tp, most):
    with pytest.raises(PlacementError, match=rf"{engines} engine\(s\) x TP {tp} = {engines * tp} GPUs do not fit the "
                                             rf"trainer's {nnodes * per_node} GPUs .*rollout.num_engines to {most} or "
                                             rf"less, or use rollout.mode=disaggregated"):
        plan_placement(nnodes=nnodes, gpus_per_node=per_node, trainer_world_size=nnodes * per_node,
                       num_engines=engines, engine_tp=tp, mode="colocated")


def test_colocated_stage_leaders_on_every_node_place():
    """Each engine rank maps memory of the trainer rank on its own GPU, which receives every stage's buckets from the
    stage's leader by the trainer's broadcast, with or without expert parallelism (rlhf/weight_bridge/from_tensor.py),
    so stage leaders and engines may be on any node.  Before, with expert parallelism every engine mapped the stage
    leaders' buckets: TP4 PP2 on 2 x 4 GPUs (stage 1 led by rank 4 on node 1) and 4 engines of TP2 over both nodes
    were refused; verl's R3 example (PP6 x EP8, 6 x 8 GPUs, 12 engines of TP4) too."""
    assert stage_leaders(8, 2) == [0, 4] and stage_leaders(16, 4) == [0, 4, 8, 12] and stage_leaders(8) == [0]
    kw = dict(mode="colocated", num_engines=1, engine_tp=2, gpus_per_node=4, nnodes=2, trainer_world_size=8)
    assert job_placement_problem(**kw) is None
    plan = plan_placement(nnodes=2, gpus_per_node=4, trainer_world_size=8, num_engines=4, engine_tp=2,
                          mode="colocated")
    assert plan.engines[3] == gpus(1, 2, 3)
    r3 = plan_placement(nnodes=6, gpus_per_node=8, trainer_world_size=48, num_engines=12, engine_tp=4,
                        mode="colocated")
    assert [r3.engine_node(i) for i in range(12)] == [n for n in range(6) for _ in range(2)]
    assert r3.engines[11] == gpus(5, 4, 5, 6, 7)


@pytest.mark.parametrize("tp,n,expected", [
    (1, 4, [gpus(0, 4), gpus(0, 5), gpus(0, 6), gpus(0, 7)]),
    (2, 2, [gpus(0, 4, 5), gpus(0, 6, 7)]),
    (4, 1, [gpus(0, 4, 5, 6, 7)]),
])
def test_disaggregated_takes_the_gpus_after_the_trainer(tp, n, expected):
    plan = plan_placement(nnodes=1, gpus_per_node=8, trainer_world_size=4, num_engines=n, engine_tp=tp,
                          mode="disaggregated")
    assert plan.engines == expected
    assert not {g for e in plan.engines for g in e} & set(plan.trainer)


def test_disaggregated_engine_on_the_second_node():
    plan = plan_placement(nnodes=2, gpus_per_node=2, trainer_world_size=2, num_engines=1, engine_tp=2,
                          mode="disaggregated")
    assert plan.trainer == gpus(0, 0, 1) and plan.engines == [gpus(1, 0, 1)]


@pytest.mark.parametrize("kw,match", [
    (dict(trainer_world_size=9, num_engines=1, engine_tp=1, mode="colocated"), "9 trainer ranks need 9 GPUs"),
    (dict(trainer_world_size=8, num_engines=3, engine_tp=4, mode="colocated"), "12 GPUs do not fit the trainer's 8"),
    (dict(trainer_world_size=8, num_engines=1, engine_tp=1, mode="disaggregated"), "left after the trainer's 8"),
    (dict(trainer_world_size=6, num_engines=2, engine_tp=2, mode="disaggregated"), "4 GPUs do not fit the 2 GPUs"),
    (dict(trainer_world_size=6, num_engines=1, engine_tp=2, mode="disaggregated"), None),
    (dict(trainer_world_size=4, num_engines=1, engine_tp=16, mode="colocated"),
     "does not fit on a node of 8 GPUs.*tensor_model_parallel_size to 8 or less"),
    (dict(trainer_world_size=8, num_engines=1, engine_tp=1, mode="spread"), "rollout.mode='spread'"),
])
def test_refusals(kw, match):
    if match is None:  # fits exactly: GPUs 6 and 7
        assert plan_placement(nnodes=1, gpus_per_node=8, **kw).engines == [gpus(0, 6, 7)]
        return
    with pytest.raises(PlacementError, match=match):
        plan_placement(nnodes=1, gpus_per_node=8, **kw)


def test_engine_spanning_two_nodes_is_refused():
    # trainer on 3 of 2x4 GPUs; a TP 2 engine after it would take GPU (0,3) and (1,0)
    with pytest.raises(PlacementError, match="span nodes"):
        plan_placement(nnodes=2, gpus_per_node=4, trainer_world_size=3, num_engines=1, engine_tp=2,
                       mode="disaggregated")


def test_actor_options_claim_no_ray_gpus_and_pin_the_node():
    plan = plan_placement(nnodes=2, gpus_per_node=2, trainer_world_size=2, num_engines=1, engine_tp=2,
                          mode="disaggregated")
    opts = engine_actor_options(0, env={"A": "1"}, plan=plan, node_ids=["a" * 56, "b" * 56])
    assert opts["num_gpus"] == 0 and opts["max_restarts"] == 0
    assert opts["runtime_env"]["env_vars"] == {"A": "1", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert opts["scheduling_strategy"].node_id == "b" * 56 and opts["scheduling_strategy"].soft is False
    cpu = engine_actor_options(0, env={})
    assert "scheduling_strategy" not in cpu and cpu["runtime_env"]["env_vars"] == {}


def test_engine_wider_than_a_node_names_the_data_and_expert_parallel_alternatives():
    """The refusal of an engine wider than a node names the node's maximum TP and what to do with the GPUs instead:
    engines of that TP over the same GPUs (data parallel across engines: 2 engines of TP 16 on 8-GPU nodes are
    4 engines of TP 8), and that expert parallelism inside an engine is not available."""
    with pytest.raises(PlacementError) as e:
        plan_placement(nnodes=4, gpus_per_node=8, trainer_world_size=32, num_engines=2, engine_tp=16, mode="colocated")
    msg = str(e.value)
    assert "tensor parallel size 16 does not fit on a node of 8 GPUs" in msg
    assert "rollout.tensor_model_parallel_size to 8 or less" in msg
    assert "data parallelism across engines instead (rollout.num_engines=4 engines of TP 8" in msg
    assert "expert parallelism inside an engine (SGLang's ep_size, verl's actor_rollout_ref.rollout." \
           "expert_parallel_size)" in msg


def test_verl_pools_share_nodes_when_both_fit_a_node():
    """verl's one-step-off dapo_7b_math_megatron_4_12.sh: 2 nodes of 8, 6 trainer + 2 rollout GPUs on each, rollout
    TP 2: the trainer's GPUs first on every node, one engine on GPUs 6-7 of each (verl's README: max(trainer.nnodes,
    rollout.nnodes) nodes when trainer.n_gpus_per_node + rollout.n_gpus_per_node fit a node)."""
    from rlhf.rollout.placement import pool_engines, pool_nodes, pool_placement

    sizes = dict(trainer_nnodes=2, trainer_per_node=6, rollout_nnodes=2, rollout_per_node=2)
    plan = pool_placement(gpus_per_node=8, engine_tp=2, **sizes)
    assert plan.trainer == [GPU(0, g) for g in range(6)] + [GPU(1, g) for g in range(6)]
    assert plan.engines == [gpus(0, 6, 7), gpus(1, 6, 7)] and pool_nodes(8, **sizes) == 2
    assert pool_engines(2, 2, 2) == 2


def test_verl_pools_take_nodes_of_their_own_when_they_do_not_share():
    """dapo_7b_math_fsdp2_64_64.sh's layout, scaled down: 2 trainer nodes x 8 and 2 rollout nodes x 8 at rollout TP 4:
    the rollout nodes come after the trainer's (trainer.nnodes + rollout.nnodes nodes), 2 engines each."""
    from rlhf.rollout.placement import pool_nodes, pool_placement

    sizes = dict(trainer_nnodes=2, trainer_per_node=8, rollout_nnodes=2, rollout_per_node=8)
    plan = pool_placement(gpus_per_node=8, engine_tp=4, **sizes)
    assert len(plan.trainer) == 16 and plan.trainer[15] == GPU(1, 7)
    assert plan.engines == [gpus(2, 0, 1, 2, 3), gpus(2, 4, 5, 6, 7), gpus(3, 0, 1, 2, 3), gpus(3, 4, 5, 6, 7)]
    assert pool_nodes(8, **sizes) == 4


@pytest.mark.parametrize("kw,match", [
    (dict(rollout_per_node=3, engine_tp=2), r"rollout.n_gpus_per_node=3 is not a multiple of the engines' tensor "
                                            r"parallel size rollout.tensor_model_parallel_size=2"),
    (dict(trainer_per_node=9), r"trainer.n_gpus_per_node=9 is more than a node's 8 GPUs: set trainer.n_gpus_per_node "
                               r"to 8 or less and use more nodes \(trainer.nnodes\)"),
])
def test_verl_pool_refusals(kw, match):
    from rlhf.rollout.placement import pool_placement

    sizes = dict(gpus_per_node=8, trainer_nnodes=1, trainer_per_node=6, rollout_nnodes=1, rollout_per_node=2,
                 engine_tp=1)
    with pytest.raises(PlacementError, match=match):
        pool_placement(**{**sizes, **kw})


def test_pool_problems_lists_every_problem_of_verls_rollout_pool():
    """One line per problem, all at once (the config check's): colocated engines with a pool, a TP that does not
    divide the rollout node's GPUs; a fitting pool has none, and a pool wider than the node is named with the node."""
    from rlhf.rollout.placement import pool_problems

    sizes = dict(trainer_nnodes=1, trainer_per_node=6, rollout_nnodes=1)
    assert pool_problems(mode="disaggregated", num_engines=1, engine_tp=2, rollout_per_node=2, gpus_per_node=8,
                         **sizes) == []
    bad = pool_problems(mode="colocated", num_engines=1, engine_tp=2, rollout_per_node=3, **sizes)
    assert len(bad) == 2 and "but rollout.mode=colocated" in bad[0] and "is not a multiple" in bad[1]
    assert pool_problems(mode="disaggregated", num_engines=3, engine_tp=1, rollout_per_node=2, **sizes) == [
        "rollout.num_engines=3 but verl's rollout pool rollout.nnodes=1 x rollout.n_gpus_per_node=2 at engine tensor "
        "parallel size 1 runs 2 engine(s); drop rollout.num_engines (the pool sets it) or the pool keys."]
    wide = pool_problems(mode="disaggregated", num_engines=1, engine_tp=2, rollout_per_node=2, gpus_per_node=4, **sizes)
    assert wide == ["verl's pools (trainer.nnodes=1 x trainer.n_gpus_per_node=6, rollout.nnodes=1 x "
                    "rollout.n_gpus_per_node=2) on nodes of 4 GPUs: trainer.n_gpus_per_node=6 is more than a node's 4 "
                    "GPUs: set trainer.n_gpus_per_node to 4 or less and use more nodes (trainer.nnodes)."]


def test_disaggregated_engines_needing_every_gpu_advise_no_negative_rank_count():
    """8 engines of TP1 on 4 GPUs with 2 trainer ranks: the message said "start fewer trainer ranks (at most -4"."""
    with pytest.raises(PlacementError) as e:
        plan_placement(nnodes=1, gpus_per_node=4, trainer_world_size=2, num_engines=8, engine_tp=1,
                       mode="disaggregated")
    msg = str(e.value)
    assert "8 engine(s) x TP 1 = 8 GPUs do not fit the 2 GPUs left after the trainer's 2" in msg
    assert "at most -" not in msg and "since the engines alone need all 4 GPUs or more, or use rollout.mode" in msg
