"""A 2-node Ray cluster on loopback (tests/ray_cluster_local.py, started as the Slurm body starts Ray) and the
Slurm body's Ray join check (recipes/_launch/ray_wait.py): all nodes up -> 0; a node missing -> exit 1 with
one line naming it; a dead head -> fails at once.  Work pinned to the second node runs there."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.ray_cluster_local import RAY_WAIT, LoopbackRayCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with LoopbackRayCluster(["n1", "n2"], num_cpus=1) as c:
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
    from tests.ray_cluster_local import _free_port

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
