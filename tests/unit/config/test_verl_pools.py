"""verl's separate trainer and rollout pools (its one-step-off recipes, verl/experimental/one_step_off_policy:
``actor_rollout_ref.hybrid_engine=False`` with ``rollout.nnodes`` / ``rollout.n_gpus_per_node`` beside
``trainer.nnodes`` / ``trainer.n_gpus_per_node``) map onto disaggregated engines: trainer.* is the trainer's pool
alone, the engines are ``rollout.nnodes x rollout.n_gpus_per_node / TP``, each node starts trainer.n_gpus_per_node
ranks (no torchrun arithmetic for the user), and every refusal names the keys the user typed."""
import re

import pytest

from rlhf.config import compose_config
from rlhf.config.validate import config_problems
from rlhf.launcher import LaunchConfigError, local_ranks
from tests.unit.config.test_placement_checks import _main, builds, files  # noqa: F401 - fixtures

HYBRID_OFF = "actor_rollout_ref.hybrid_engine=False"
# verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh (NNODES=1, NGPUS_PER_NODE=8, 2 for rollout)
ONE_NODE_2_6 = [HYBRID_OFF, "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.nnodes=1",
                "trainer.n_gpus_per_node=6", "rollout.nnodes=1", "rollout.n_gpus_per_node=2"]
# dapo_7b_math_megatron_4_12.sh: NNODES=2, 6 trainer + 2 rollout GPUs on each node, gen_tp=2, train_tp=2
TWO_NODES_4_12 = [HYBRID_OFF, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.nnodes=2",
                  "trainer.n_gpus_per_node=6", "rollout.nnodes=2", "rollout.n_gpus_per_node=2"]


def test_one_step_off_keys_compose_to_disaggregated_engines_of_the_rollout_pool():
    c = compose_config(ONE_NODE_2_6)
    assert (c.rollout.mode, c.rollout.num_engines, c.rollout.tensor_model_parallel_size) == ("disaggregated", 1, 2)
    assert (c.rollout.nnodes, c.rollout.n_gpus_per_node, c.trainer.n_gpus_per_node) == (1, 2, 6)
    assert local_ranks(c, cuda_count=8) == 6  # the trainer's pool, not 8 - the engines' GPUs
    c = compose_config(TWO_NODES_4_12, recipe="gsm8k_ppo_qwen2_7b")  # the recipe's 4 engines give way to the pool's
    assert (c.rollout.mode, c.rollout.num_engines) == ("disaggregated", 2)
    assert local_ranks(c, cuda_count=8) == 6
    # 12 trainer GPUs at TP2: DP 6 (the recipe's 64 x 5 = 320 sequences per mini batch do not split over 6)
    assert [p for p in config_problems(c) if "data-parallel size 6" in p]
    assert compose_config(["actor_rollout_ref.hybrid_engine=True"]).rollout.mode == "colocated"


def test_cfg_job_prints_the_pool_mapping(builds, files, capsys):  # noqa: F811
    code = _main(["recipe=gsm8k_ppo_qwen2_7b", *ONE_NODE_2_6, "actor_rollout_ref.actor.megatron."
                  "tensor_model_parallel_size=2", "data.train_batch_size=96", "actor.ppo_mini_batch_size=48",
                  "critic.ppo_mini_batch_size=48", *files, "--cfg", "job"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rollout = out[out.index("\nrollout:"):]
    for line in ("  mode: disaggregated", "  tensor_model_parallel_size: 2", "  num_engines: 1",
                 "  n_gpus_per_node: 2", "  nnodes: 1"):
        assert f"\n{line}\n" in rollout, rollout[:800]
    assert re.search(r"\ntrainer:\n(  .*\n)*  n_gpus_per_node: 6\n", out) and builds == []


@pytest.mark.parametrize("extra,expected", [
    # the pool without hybrid_engine=False: colocated engines cannot have GPUs of their own
    (["trainer.n_gpus_per_node=6", "rollout.n_gpus_per_node=2"],
     "rollout.n_gpus_per_node=2 gives the engines GPUs of their own (verl's rollout pool, rollout.nnodes=1 x "
     "rollout.n_gpus_per_node=2) but rollout.mode=colocated; set actor_rollout_ref.hybrid_engine=False"),
    ([HYBRID_OFF, "trainer.n_gpus_per_node=6", "rollout.n_gpus_per_node=3",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "rollout.n_gpus_per_node=3 is not a multiple of the engines' tensor parallel size rollout.tensor_model_parallel_"
     "size=2 (verl: actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ([HYBRID_OFF, "trainer.n_gpus_per_node=6", "rollout.n_gpus_per_node=2", "rollout.num_engines=3"],
     "rollout.num_engines=3 but verl's rollout pool rollout.nnodes=1 x rollout.n_gpus_per_node=2 at engine tensor "
     "parallel size 2 runs 1 engine(s)"),
    # the trainer's pool against TP4 (the recipe's): the arithmetic is done, naming the key to change
    ([HYBRID_OFF, "trainer.nnodes=2", "trainer.n_gpus_per_node=5", "rollout.n_gpus_per_node=2"],
     "= 4 does not divide the 10 trainer GPUs of trainer.nnodes=2 x trainer.n_gpus_per_node=5 (verl's trainer pool); "
     "set trainer.n_gpus_per_node=6 (12 trainer GPUs, a multiple of 4)"),
    # our own disaggregated layout (the job's GPUs less the engines'): the same, never "torchrun --nproc_per_node"
    (["rollout.mode=disaggregated", "trainer.n_gpus_per_node=8", "rollout.num_engines=1",
      "rollout.tensor_model_parallel_size=1"],
     "= 4 does not divide the 7 trainer GPUs of trainer.nnodes=1 x trainer.n_gpus_per_node=8 less the engines' "
     "rollout.num_engines=1 x rollout.tensor_model_parallel_size=1; set trainer.n_gpus_per_node=9 (8 trainer GPUs"),
])
def test_pool_refusals_name_the_keys(extra, expected):
    problems = config_problems(compose_config(extra, recipe="gsm8k_ppo_qwen2_7b"))
    assert any(expected in p for p in problems), "\n".join(problems)
    assert not any("torchrun" in p for p in problems)


def test_pool_placement_at_the_start_of_a_run_and_the_launcher():
    c = compose_config([HYBRID_OFF, "trainer.n_gpus_per_node=8", "rollout.n_gpus_per_node=9"])
    msg = "\n".join(config_problems(c, gpus_per_node=8))  # the node's GPUs, known at the start of a run
    assert "rollout.n_gpus_per_node=9 is more than a node's 8 GPUs" in msg, msg
    c = compose_config([HYBRID_OFF, "rollout.n_gpus_per_node=8"])
    with pytest.raises(LaunchConfigError, match=r"rollout.n_gpus_per_node=8 \(verl's rollout pool\) takes all of "
                                                r"this node's 8 GPUs and trainer.n_gpus_per_node is not set"):
        local_ranks(c, cuda_count=8)
    assert local_ranks(compose_config([HYBRID_OFF, "rollout.n_gpus_per_node=2"]), cuda_count=8) == 6


def test_newer_verls_actor_rollout_ref_pool_keys():
    """The newer verl (verl-project) keeps the pool under actor_rollout_ref.rollout: nnodes 0 (its default) is no
    pool, and n_gpus_per_node's default (``${oc.select:trainer.n_gpus_per_node,8}``) counts only in a pool; given,
    they are the pool (one-step-off's main_ppo copies rollout.* there)."""
    default = compose_config(["actor_rollout_ref.rollout.nnodes=0", "trainer.n_gpus_per_node=8",
                              "actor_rollout_ref.rollout.n_gpus_per_node=${oc.select:trainer.n_gpus_per_node,8}"])
    assert (default.rollout.mode, default.rollout.nnodes, default.rollout.n_gpus_per_node) == ("colocated", None, None)
    pool = compose_config([HYBRID_OFF, "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.nnodes=1",
                           "actor_rollout_ref.rollout.n_gpus_per_node=2"])
    assert (pool.rollout.mode, pool.rollout.nnodes, pool.rollout.n_gpus_per_node, pool.rollout.num_engines) == (
        "disaggregated", 1, 2, 2)
    assert not config_problems(pool)


@pytest.mark.parametrize("order", [1, -1])
def test_colocated_mode_with_hybrid_engine_false_is_refused_naming_both(order, capsys):
    """rollout.mode=colocated typed beside verl's hybrid_engine=False used to become disaggregated (the later one
    won, silently): refused at --cfg, either order, naming both keys; settings that agree pass."""
    from rlhf.main import main

    typed = ["rollout.mode=colocated", HYBRID_OFF][::order]
    assert main(["recipe=quickstart", *typed, "--cfg", "job"]) == 2
    err = capsys.readouterr().err
    assert (f"{typed[0]} and {typed[1]} contradict each other: they set rollout.mode to "
            f"{'colocated' if order == 1 else 'disaggregated'!r}") in err, err
    assert compose_config([HYBRID_OFF, "rollout.mode=disaggregated"]).rollout.mode == "disaggregated"
    assert compose_config(["rollout.mode=colocated", "actor_rollout_ref.hybrid_engine=True"]).rollout.mode == \
        "colocated"
