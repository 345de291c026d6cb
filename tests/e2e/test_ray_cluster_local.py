"""A 2-node Ray cluster on loopback (tests/support/ray_cluster_local.py, started as the Slurm body starts Ray) and the
Slurm body's Ray join check (recipes/_launch/ray_wait.py): all nodes up -> 0; a node missing -> exit 1 with
one line naming it; a dead head -> fails at once.  Work pinned to the second node runs there.

On the same cluster, the GSM8K tiny recipe (TP2) runs as two "nodes", one rank each: node n1 is the one-command
form submitted as a Ray job (its launcher hosts the static rendezvous on 127.0.0.1), node n2 is
``torchrun --nnodes=2 --node_rank=1``; the disaggregated rollout engine must run on n2 (the other node than rank
0's), its weights synced over the distributed transport and read back, a checkpoint written.  Then the one-node
command (its launcher starts both TP ranks) as a Ray job.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.gsm8k_mini import ONE_STEP, check_one_step_run, data_overrides, write_gsm8k_mini
from tests.support.ray_cluster_local import RAY_WAIT, LoopbackRayCluster, _free_port

from tests.support.paths import REPO
RUN_TIMEOUT_S = 900

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    # RLHF_TEST_RAY_DIR=<short dir>: the nodes' temp dirs (Ray's logs) go there and are kept after the run
    keep = os.environ.get("RLHF_TEST_RAY_DIR")
    with LoopbackRayCluster(["n1", "n2"], num_cpus=1, dashboard=True, base_dir=keep) as c:
        yield c


def test_join_check_passes_with_every_node(cluster):
    r = cluster.wait_for_nodes(["n1", "n2"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Ray: 2/2 nodes up (n1, n2)" in r.stdout


def test_join_check_fails_with_a_missing_node(cluster):
    t0 = time.time()
    r = cluster.wait_for_nodes(["n1", "n2", "n3"], timeout=4)
    assert r.returncode == 1
    assert "ERROR: only 2 of 3 Ray nodes joined" in r.stderr and "missing: n3" in r.stderr, r.stderr
    assert time.time() - t0 < 60
    r = cluster.wait_for_nodes(["3"], timeout=2)  # a count works too
    assert r.returncode == 1 and "only 2 of 3" in r.stderr


def test_join_check_fails_at_once_when_the_head_died(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from tests.support.ray_cluster_local import _free_port

    t0 = time.time()
    r = subprocess.run([sys.executable, str(RAY_WAIT), "--address", f"127.0.0.1:{_free_port()}", "--nodes", "n1",
                        "--timeout", "120", "--watch-pid", str(dead.pid)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "did not start" in r.stderr, r.stderr
    assert time.time() - t0 < 30


def test_work_pinned_to_the_second_node_runs_there(cluster):
    code = textwrap.dedent("""
        import ray
        ray.init(logging_level="ERROR")
        ids = {n["NodeName"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        where = ray.remote(resources={"n2": 0.01}, num_cpus=0)(lambda: ray.get_runtime_context().get_node_id())
        print("DRIVER", ids["n1"] == ray.get_runtime_context().get_node_id(), "TASK", ray.get(where.remote()) == ids["n2"])
    """)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **cluster.driver_env()},
                       capture_output=True, text=True, timeout=180)
    assert "DRIVER True TASK True" in r.stdout, r.stdout + r.stderr


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process (one deadline); kill each one's process group after (leftovers, or on timeout)."""
    deadline, rcs = time.time() + timeout, []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            rcs.append(None)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    return rcs


def test_two_nodes_colocated_engines_on_both_nodes(cluster, tmp_path):
    """Colocated engines on every node (verl's replica layout): the trainer at TP1 over two nodes, one rank each
    (node n1 the `NODE_RANK=0` command, node n2 `torchrun --nnodes=2 --node_rank=1`), two engines: engine 0 runs on n1
    beside rank 0, engine 1 on n2 beside rank 1, the rank whose memory it maps in the weight sync
    (rlhf/rollout/placement.holder_ranks; before, both engines had to be on rank 0's node).  One step: the
    sync reaches both engines and check mode reads the weights back from each; a checkpoint written."""
    data, run, port = write_gsm8k_mini(tmp_path / "data"), tmp_path / "run", _free_port()
    overrides = ["recipe=gsm8k_ppo_tiny_cpu", *data_overrides(data), f"trainer.default_local_dir={run}",
                 "parallel.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1", "rollout.num_engines=2",
                 "rollout.weight_sync_check=true",
                 "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2", *ONE_STEP]
    rdzv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    node0 = [sys.executable, "-m", "rlhf.main", "trainer.nnodes=2", *overrides]
    node1 = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--nproc_per_node=1",
             "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "rlhf.main", *overrides]
    common = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    before = cluster.actor_logs("SGLangEngine")  # engines of earlier tests on this cluster
    procs = [subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **cluster.driver_env(), **common, **env},
                              stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
             for cmd, env, name in ((node0, {"RLHF_NODE_NAME": "n1", "NODE_RANK": "0", **rdzv}, "n1"),
                                    (node1, {"RLHF_NODE_NAME": "n2"}, "n2"))]
    rcs = _finish(procs, RUN_TIMEOUT_S)
    n1, n2 = ((tmp_path / f"{n}.log").read_text(errors="replace") for n in ("n1", "n2"))
    assert rcs == [0, 0], f"exit codes {rcs}\n--- n1\n{n1[-5000:]}\n--- n2\n{n2[-3000:]}\n{cluster.logs()}"
    assert "[rollout] colocated: engine 0 on Ray node n1, engine 1 on Ray node n2 (2 Ray node(s))" in n1, n1[-4000:]
    engines = sorted(node for f, node in cluster.actor_logs("SGLangEngine").items() if f not in before)
    assert engines == ["n1", "n2"], engines  # where they really ran: their Ray worker logs under each node's dir
    check_one_step_run(n1, run)


def test_one_node_command_as_a_ray_job(cluster, tmp_path):
    """The README's Ray job submission: the one-node command (its launcher starts the TP2 ranks) as a Ray job on
    the cluster's head; `ray job submit` waits, streams the job's output and exits 0 only when it succeeded."""
    data, run = write_gsm8k_mini(tmp_path / "data"), tmp_path / "run"
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", f"--address={cluster.dashboard_url}",
           "--working-dir=.", "--runtime-env-json", '{"env_vars": {"OMP_NUM_THREADS": "1"}}', "--",
           "python", "-m", "rlhf.main", "recipe=gsm8k_ppo_tiny_cpu", *data_overrides(data),
           f"trainer.default_local_dir={run}", *ONE_STEP]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **cluster.driver_env()},
                            stdout=open(tmp_path / "job.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    (rc,) = _finish([proc], RUN_TIMEOUT_S)
    text = (tmp_path / "job.log").read_text(errors="replace")
    assert rc == 0, f"exit {rc}\n{text[-6000:]}\n{cluster.logs()}"
    job = re.search(r"Job '(raysubmit_\w+)' succeeded", text)
    assert job, text[-4000:]
    assert re.search(r"^\[rlhf.main\] starting 2 rank\(s\) on ", text, re.M), text[-4000:]  # TP2 on CPU
    check_one_step_run(text, run)


def test_two_nodes_node0_as_a_ray_job_engine_on_the_second(cluster, tmp_path):
    """One 2-node run: node n1 is the one-command form submitted as a Ray job (`ray job submit ... -- python -m
    rlhf.main ... trainer.nnodes=2`, NODE_RANK=0: its launcher hosts the static rendezvous), node n2 is `torchrun
    --nnodes=2 --node_rank=1` over 127.0.0.1; RLHF_NODE_NAME tells each node's ranks their Ray node (the Slurm
    body names Ray nodes after Slurm nodes, which the trainer reads itself).  The disaggregated engine must run on
    n2, its weights synced over the distributed transport and read back, a checkpoint written."""
    data, run, port = write_gsm8k_mini(tmp_path / "data"), tmp_path / "run", _free_port()
    overrides = ["recipe=gsm8k_ppo_tiny_cpu", *data_overrides(data), f"trainer.default_local_dir={run}",
                 "rollout.mode=disaggregated", "rollout.weight_sync_check=true", *ONE_STEP]
    rdzv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    job_env = {"OMP_NUM_THREADS": "1", "RLHF_NODE_NAME": "n1", "NODE_RANK": "0", **rdzv}
    node0 = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", f"--address={cluster.dashboard_url}",
             "--working-dir=.", "--runtime-env-json", json.dumps({"env_vars": job_env}), "--",
             "python", "-m", "rlhf.main", "trainer.nnodes=2", *overrides]
    node1 = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--nproc_per_node=1",
             "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "rlhf.main", *overrides]
    node1_env = {"RLHF_NODE_NAME": "n2", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                 "PYTHONPATH": str(REPO)}
    before = cluster.actor_logs("SGLangEngine")  # engines of earlier tests on this cluster
    procs = [subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **cluster.driver_env(), **env},
                              stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
             for cmd, env, name in ((node0, {}, "n1"), (node1, node1_env, "n2"))]
    rcs = _finish(procs, RUN_TIMEOUT_S)
    n1, n2 = ((tmp_path / f"{n}.log").read_text(errors="replace") for n in ("n1", "n2"))
    assert rcs == [0, 0], f"exit codes {rcs}\n--- n1\n{n1[-5000:]}\n--- n2\n{n2[-3000:]}\n{cluster.logs()}"
    # `ray job submit` waited for the job, streamed its output and saw it succeed
    assert re.search(r"Job '(raysubmit_\w+)' succeeded", n1), n1[-4000:]
    assert re.search(r"^\[rlhf.main\] starting 1 rank\(s\) on \S+ as node 0 of 2 ", n1, re.M), n1[-4000:]
    # the plan: engine 0 on Ray node n2 (rank 0 is on n1) ...
    assert "[rollout] disaggregated: engine 0 on Ray node n2 (2 Ray node(s))" in n1, n1[-4000:]
    # ... and where it really ran: its Ray worker process logged under n2's temp dir, not n1's
    engines = {f: node for f, node in cluster.actor_logs("SGLangEngine").items() if f not in before}
    assert set(engines.values()) == {"n2"}, engines
    check_one_step_run(n1, run)
