"""A multi-node Ray cluster on this one machine (loopback), started the way the Slurm body starts one:
one ``ray start --block`` per node (head first), each with its own node name, temp dir and a custom resource
named after the node (``{"n2": 1}``) so work can be pinned to a "node"; an auth token of its own.

    with LoopbackRayCluster(["n1", "n2"], num_cpus=1) as cluster:
        env = cluster.driver_env()          # RAY_ADDRESS + auth for a driver process (e.g. torchrun ranks)
        ...                                 # ray.remote(resources={"n2": 0.01}) runs on the second node

Each ``ray start --block`` runs in its own session; ``stop()`` ends each node's whole process group by pid
(no ``ray stop``, which would stop every Ray of the user on the machine).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY_WAIT = Path(__file__).resolve().parents[2] / "recipes" / "_launch" / "ray_wait.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackRayCluster:
    """Ray head + workers on 127.0.0.1, one ``ray start --block`` process group per node."""

    def __init__(self, nodes: list[str], num_cpus: int = 1, base_dir: str | None = None, dashboard: bool = False):
        self.nodes = list(nodes)
        # the head's dashboard (Ray's job server: ``ray job submit --address <dashboard_url>``)
        self.dashboard_url = f"http://127.0.0.1:{_free_port()}" if dashboard else None
        self.num_cpus = num_cpus
        self._own_dir = base_dir is None  # a temp dir of ours is removed by stop()
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="rayc-", dir="/tmp"))
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.token = os.urandom(16).hex()
        self.procs: dict[str, subprocess.Popen] = {}

    def driver_env(self) -> dict[str, str]:
        """Environment for processes that connect to this cluster (``ray.init()`` picks RAY_ADDRESS)."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def _start_node(self, name: str, head: bool) -> None:
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--node-name={name}",
                f"--temp-dir={self.dir / name}", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
                f"--resources={json.dumps({name: 1})}", "--dashboard-agent-listen-port=0", "--disable-usage-stats"]
        if head:
            args += ["--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
                     f"--ray-client-server-port={_free_port()}"]
            if self.dashboard_url:
                args += ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                         f"--dashboard-port={self.dashboard_url.rsplit(':', 1)[1]}"]
            else:
                args += ["--include-dashboard=false"]
        else:
            args += [f"--address={self.address}"]
        env = {**os.environ, **self.driver_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        log = open(self.dir / f"{name}.log", "a")
        self.procs[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def start(self, timeout: float = 300, retries: int = 2) -> "LoopbackRayCluster":
        """Start the head (first name), then the workers once it is up; return when all are alive (raises
        RuntimeError).  A node's ``ray start`` gives up when its raylet has not registered within 30 s (Ray's
        fixed wait), which a loaded machine can exceed: then the whole cluster is started again, up to
        ``retries`` times within ``timeout`` s."""
        self.dir.mkdir(parents=True, exist_ok=True)
        deadline = time.time() + timeout
        for attempt in range(retries + 1):
            try:
                r = self._start_all(deadline)
            except BaseException:
                self.stop()
                raise
            if r is None:
                return self
            self._stop_nodes()
            if time.time() > deadline or attempt == retries:
                self.stop()
                raise RuntimeError(f"loopback Ray cluster did not come up ({attempt + 1} attempt(s)): "
                                   f"{r.stderr.strip()}\n{self.logs()}")
        return self

    def _start_all(self, deadline: float) -> subprocess.CompletedProcess | None:
        """One attempt: the head, its join check, the workers, the join check of all; None when all are up,
        else the failed check (a node's ``ray start`` exited, or the deadline passed).  Fresh ports each time."""
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        if self.dashboard_url:
            self.dashboard_url = f"http://127.0.0.1:{_free_port()}"
        self._start_node(self.nodes[0], head=True)
        for names in (self.nodes[:1], self.nodes):
            if names is self.nodes:
                for name in self.nodes[1:]:
                    self._start_node(name, head=False)
            while True:
                r = self.wait_for_nodes(names, max(20.0, min(60.0, deadline - time.time())),
                                        watch_pid=self.procs[self.nodes[0]].pid)
                if r.returncode == 0:
                    break
                if time.time() > deadline or any(p.poll() is not None for p in self.procs.values()):
                    return r
        return None

    def wait_for_nodes(self, names: list[str], timeout: float, watch_pid: int | None = None
                       ) -> subprocess.CompletedProcess:
        """Run recipes/_launch/ray_wait.py (the Slurm body's join check) against this cluster."""
        cmd = [sys.executable, str(RAY_WAIT), "--address", self.address, "--nodes", *names, "--timeout", str(timeout)]
        if watch_pid is not None:
            cmd += ["--watch-pid", str(watch_pid)]
        return subprocess.run(cmd, env={**os.environ, **self.driver_env()}, capture_output=True, text=True,
                              timeout=timeout + 120)

    def actor_logs(self, class_name: str) -> dict[Path, str]:
        """Worker log files that show an actor of ``class_name`` -> the name of the node they are under (Ray
        writes ``:actor_name:<class>`` into the log of the worker process that runs an actor, in its node's
        temp dir).  Compare two calls to find where a run's actors went."""
        found = {}
        for name in self.nodes:
            for f in (self.dir / name).glob("session_*/logs/worker-*.out"):
                if f":actor_name:{class_name}" in f.read_text(errors="replace"):
                    found[f.resolve()] = name
        return found

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.dir.glob("*.log")))

    def _stop_nodes(self) -> None:
        """Workers first (while the head still answers), then the head: TERM, then KILL the process group."""
        for name in reversed(list(self.procs)):
            p = self.procs.pop(name)
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # leftovers (agents, workers) of this node only
            except ProcessLookupError:
                pass
            p.wait()

    def stop(self) -> None:
        """Stop every node; remove the temp dir when it is ours."""
        self._stop_nodes()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LoopbackRayCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    names = sys.argv[1:] or ["n1", "n2"]
    cluster = LoopbackRayCluster(names).start()
    print(" ".join(f"{k}={v}" for k, v in cluster.driver_env().items()), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        cluster.stop()
