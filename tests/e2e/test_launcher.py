"""One command per node (rlhf/launcher.py): how many ranks `python -m rlhf.main` starts on this node, where the
multi-node rendezvous comes from (NODE_RANK/MASTER_ADDR/MASTER_PORT or Slurm), the errors (exit code 2 before
anything starts), and the elastic agent itself (ranks, world size, exit codes, a two-node rendezvous on
127.0.0.1) with a stand-in for rlhf.main (tests/support/launch_probe.py)."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf.launch_env import launch_env
from rlhf.launcher import LaunchConfigError, NodeLaunch, local_ranks, plan_launch
from parallel.distributed import slurm_job_ports
from tests.support.dist_utils import free_port

from tests.support.paths import REPO


def cfg(tp=1, pp=1, gpus=None, nnodes=None, mode="colocated", engines=1, engine_tp=1):
    return OmegaConf.create({"trainer": {"n_gpus_per_node": gpus, "nnodes": nnodes},
                             "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
                             "rollout": {"mode": mode, "num_engines": engines, "tensor_model_parallel_size": engine_tp}})


SINGLE = launch_env({})


@pytest.mark.parametrize("c,cuda,expected", [
    (cfg(tp=2), 0, 2),                                   # CPU: what the config needs (TP2 -> 2 ranks)
    (cfg(tp=2, pp=2), 0, 4),
    (cfg(tp=2, nnodes=2), 0, 1),                         # TP2 over two nodes: one rank each
    (cfg(tp=2, pp=2, nnodes=2), 0, 2),
    (cfg(tp=2, gpus=3), 0, 3),                           # trainer.n_gpus_per_node wins
    (cfg(tp=2), 8, 8),                                   # GPU: every visible GPU
    (cfg(gpus=4), 8, 4),
    (cfg(mode="disaggregated", engines=2, engine_tp=2), 8, 4),   # one node: the engines take the last 4
    (cfg(mode="disaggregated", engines=2, engine_tp=2, nnodes=2), 8, 8),  # engines on other Ray nodes
    (cfg(mode="disaggregated", engines=2, engine_tp=2, gpus=8), 0, 4),   # n_gpus_per_node: the job's GPUs
])
def test_local_ranks(c, cuda, expected):
    assert local_ranks(c, cuda_count=cuda) == expected


def test_local_ranks_errors():
    with pytest.raises(LaunchConfigError, match=r"tensor x context x pipeline parallel = 2 ranks do not split over "
                                                r"trainer.nnodes=3.*trainer.n_gpus_per_node"):
        local_ranks(cfg(tp=2, nnodes=3), cuda_count=0)
    with pytest.raises(LaunchConfigError, match=r"take 2 of this node's 2 GPUs and leave none for the trainer"):
        local_ranks(cfg(mode="disaggregated", engine_tp=2), cuda_count=2)


def test_plan_single_node():
    assert plan_launch(cfg(), SINGLE, {}, cuda_count=0) is None           # one rank: trains in this process
    assert plan_launch(cfg(tp=2), SINGLE, {}, cuda_count=0) == NodeLaunch(2, 1, 0, None, None, "local")
    assert plan_launch(cfg(), SINGLE, {}, cuda_count=8).world_size == 8
    torchrun = launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert plan_launch(cfg(tp=2, nnodes=2), torchrun, {}, cuda_count=0) is None   # torchrun started us


def test_plan_multi_node_from_env():
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    assert plan_launch(cfg(tp=2, nnodes=2), SINGLE, env, cuda_count=0) == NodeLaunch(1, 2, 1, "127.0.0.1", 29500, "env")
    env["MASTER_PORT"] = "23456"
    assert plan_launch(cfg(gpus=8, nnodes=4), SINGLE, env, cuda_count=8).master_port == 23456
    # one rank per node is still a launch: the agents do the rendezvous
    assert plan_launch(cfg(gpus=1, nnodes=2), SINGLE, env, cuda_count=0).world_size == 2


@pytest.mark.parametrize("env,match", [
    ({}, r"trainer.nnodes=2: NODE_RANK and MASTER_ADDR not set.*NODE_RANK=<0..1> MASTER_ADDR=<node 0's address>"),
    ({"NODE_RANK": "0"}, r"MASTER_ADDR not set.*srun --ntasks-per-node=1"),
    ({"NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1"}, r"node rank 2 \(from NODE_RANK\) is outside 0..1"),
    ({"NODE_RANK": "one", "MASTER_ADDR": "127.0.0.1"}, r"NODE_RANK='one' is not an integer"),
    ({"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
    ({"NODE_RANK": "0", "MASTER_ADDR": "no-such-host.invalid"}, r"MASTER_ADDR='no-such-host.invalid' does not resolve"),
])
def test_plan_multi_node_errors(env, match):
    with pytest.raises(LaunchConfigError, match=match):
        plan_launch(cfg(tp=2, nnodes=2), SINGLE, env, cuda_count=0)


def slurm_env(procid, ntasks, nodeid, nnodes=2, **extra):
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_NODEID": str(nodeid),
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_NODES": str(nnodes),
            **extra}


def test_plan_slurm_one_task_per_node_launches_the_node():
    env = slurm_env(1, 2, 1)
    plan = plan_launch(cfg(gpus=4, nnodes=2), launch_env(env), env, cuda_count=4)
    assert plan == NodeLaunch(4, 2, 1, "127.0.0.1", slurm_job_ports(4242)[0], "slurm")
    env = slurm_env(0, 2, 0, MASTER_ADDR="localhost", MASTER_PORT="31000")
    plan = plan_launch(cfg(gpus=4, nnodes=2), launch_env(env), env, cuda_count=4)
    assert (plan.node_rank, plan.master_addr, plan.master_port) == (0, "localhost", 31000)


def test_plan_slurm_one_task_per_rank_is_the_rank():
    env = slurm_env(5, 8, 1)                                     # recipes' run_slurm.sbatch: a task per GPU
    assert plan_launch(cfg(gpus=4, nnodes=2), launch_env(env), env, cuda_count=4) is None
    env = slurm_env(1, 2, 1)
    assert plan_launch(cfg(tp=2), launch_env(env), env, cuda_count=0) is None          # nnodes not declared
    assert plan_launch(cfg(tp=2, nnodes=2), launch_env(env), env, cuda_count=0) is None  # 1 rank per node


def test_main_exits_2_before_anything_starts(capsys):
    from rlhf.main import main

    assert main(["recipe=quickstart", "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "NODE_RANK and MASTER_ADDR not set" in err and "Traceback" not in err


# ---- the elastic agent with a stand-in for rlhf.main ------------------------------------------------------------

def run_nodes(plans, env=None, timeout=180):
    """Run rlhf.launcher.run_node(plan, ["a=1"], module="tests.support.launch_probe") for each plan in its own process;
    returns [(exit code, output)]."""
    procs = []
    for plan in plans:
        code = textwrap.dedent(f"""
            import sys
            from rlhf.launcher import NodeLaunch, run_node
            sys.exit(run_node(NodeLaunch{dataclasses.astuple(plan)!r}, ["a=1"], module="tests.support.launch_probe"))
        """)
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO),
                                                                     **(env or {})}))
    return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]


def probes(out):
    """The stand-in's "PROBE K=V ..." records as dicts (a record starts at each "PROBE ", even mid-line: the ranks
    write to one stream)."""
    return [dict(kv.split("=", 1) for kv in line.split()[1:])
            for line in out.replace("PROBE ", "\nPROBE ").splitlines() if line.startswith("PROBE ")]


@pytest.mark.slow
@pytest.mark.dist
def test_agent_starts_the_local_ranks_and_keeps_exit_codes():
    [(rc, out)] = run_nodes([NodeLaunch(2, 1, 0, None, None, "local")])
    assert rc == 0, out
    ranks = sorted((p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"], p["ARGS"]) for p in probes(out))
    assert ranks == [("0", "0", "2", "a=1"), ("1", "1", "2", "a=1")], out
    assert "starting 2 rank(s) on" in out
    [(rc, out)] = run_nodes([NodeLaunch(2, 1, 0, None, None, "local")], env={"PROBE_FAIL_RANK": "1",
                                                                             "PROBE_EXIT_CODE": "17"})
    assert rc == 17 and "rank 1 exited with 17" in out, out


@pytest.mark.slow
@pytest.mark.dist
def test_two_nodes_meet_on_loopback():
    port = free_port()
    results = run_nodes([NodeLaunch(2, 2, r, "127.0.0.1", port, "env") for r in (0, 1)])
    assert [rc for rc, _ in results] == [0, 0], results
    seen = {int(p["RANK"]): (p["GROUP_RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"]) for _, out in results
            for p in probes(out)}
    # node 0 holds global ranks 0-1 (rank 0 on the master's node), node 1 ranks 2-3
    assert seen == {0: ("0", "0", "4"), 1: ("0", "1", "4"), 2: ("1", "0", "4"), 3: ("1", "1", "4")}, results
    assert all(re.search(r"as node [01] of 2 \(rendezvous 127.0.0.1:\d+, from env\)", out) for _, out in results)


@pytest.mark.slow
@pytest.mark.dist
def test_a_missing_node_fails_the_rendezvous_clearly():
    [(rc, out)] = run_nodes([NodeLaunch(1, 2, 1, "127.0.0.1", free_port(), "env")],
                            env={"RLHF_RENDEZVOUS_TIMEOUT": "5"}, timeout=240)
    assert rc == 1 and "node 1: the rendezvous of 2 nodes at 127.0.0.1:" in out, out
