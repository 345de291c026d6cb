"""A real multi-node Slurm cluster on this one machine, for tests of the recipes' sbatch scripts.

Debian's ``slurmctld``/``slurmd``/``slurm-client`` packages (installed on demand with apt when we are root),
one slurmctld and one ``slurmd -N n<i>`` per node, all on 127.0.0.1 with their own free ports.  Everything
(config, state, spool, logs, pid files, munge socket and key) lives in one private directory, so the
cluster touches no system-wide Slurm or munge set-up and two clusters may run side by side.  The daemons
run in the foreground as our children and are stopped by pid.

    with LocalSlurm(nodes=2) as slurm:            # or LocalSlurm.start_or_skip_reason()
        job = slurm.sbatch(["-N", "2", "script.sbatch"], cwd=repo)
        state, rc = slurm.wait(job)

From a shell: ``python -m tests.support.slurm_local [NODES]`` starts one and prints the ``SLURM_CONF`` to export;
Ctrl-C stops it.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
                                      None)


def ensure_slurm_installed() -> str | None:
    """Install the Debian packages when a binary is missing.  Returns None when Slurm is usable, else why not."""
    missing = [b for b in BINARIES if not _which(b)]
    if not missing:
        return None
    if os.geteuid() != 0:
        return f"Slurm binaries {missing} missing and not root (cannot apt-get install {' '.join(PACKAGES)})"
    if not shutil.which("apt-get"):
        return f"Slurm binaries {missing} missing and no apt-get on this machine"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            return f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout)[-800:]}"
    missing = [b for b in BINARIES if not _which(b)]
    return f"still missing after apt-get install: {missing}" if missing else None


class LocalSlurm:
    """One slurmctld + ``nodes`` slurmd (n1..nN) on 127.0.0.1, configured and owned by this object."""

    def __init__(self, nodes: int = 2, cpus: int | None = None, base_dir: str | None = None):
        self.nodes = nodes
        # at least 2 CPUs a node (config_overrides: slurmd trusts the config), so two 1-CPU jobs fit side by side
        self.cpus = cpus or max(2, os.cpu_count() or 1)
        # short path: Slurm and Ray put unix sockets below it
        self._own_dir = base_dir is None  # a temp dir of ours is removed by stop()
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
            del self.env[k]  # never inherit an outer allocation

    # ------------------------------------------------------------------ set-up
    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log", "run", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        mem = max(1000, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20) // (2 * self.nodes))
        lines = [
            # a random first job id: job-id-derived ports and temp dirs differ from another local cluster's
            "ClusterName=local", f"FirstJobId={random.randint(1000, 999_000)}",
            f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d}/munge/munge.socket",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2", "SlurmdParameters=config_overrides", "SlurmUser=root", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MinJobAge=600",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid", f"SlurmdPidFile={d}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd.%n.log",
        ]
        for i in range(1, self.nodes + 1):
            lines.append(f"NodeName=n{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={self.cpus} RealMemory={mem} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes=n[1-{self.nodes}] Default=YES MaxTime=INFINITE State=UP "
                     "OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        for i in range(1, self.nodes + 1):
            (d / "spool" / f"n{i}").mkdir(exist_ok=True)

    def _start_munge(self) -> None:
        m = self.dir / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # -F: foreground (our child); --force: run as root; all paths private to this cluster
        self._spawn([_which("munged"), "-F", "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
                     f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                    "munged")
        self._wait_for(lambda: (m / "munge.socket").exists(), 20, "munged socket")

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.dir / "log" / f"{name}.stdout", "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _wait_for(self, ok, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if ok():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"local Slurm: {dead} exited while waiting for {what}; logs in {self.dir}/log\n"
                                   + self.logs_tail())
            time.sleep(0.5)
        raise RuntimeError(f"local Slurm: no {what} after {timeout:.0f} s; logs in {self.dir}/log\n" + self.logs_tail())

    def start(self) -> "LocalSlurm":
        """Write the config, start munged, slurmctld and the slurmd's; return once every node is idle."""
        self._write_config()
        try:
            self._start_munge()
            self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for i in range(1, self.nodes + 1):
                self._spawn([_which("slurmd"), "-D", "-N", f"n{i}", "-f", str(self.conf)], f"slurmd.n{i}")
            self._wait_for(lambda: self.idle_nodes() >= self.nodes, 60, f"{self.nodes} idle nodes")
        except BaseException:
            self.stop()
            raise
        return self

    def idle_nodes(self) -> int:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        return sum(1 for line in r.stdout.splitlines() if line.split()[-1:] == ["idle"])

    # ------------------------------------------------------------------ use
    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(cmd, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              check=check, timeout=kw.pop("timeout", 60), **kw)

    def sbatch(self, args: list[str], cwd: str | os.PathLike, env: dict | None = None) -> int:
        """Submit; returns the job id."""
        r = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env or {})
        return int(r.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> tuple[str, int | None]:
        """(state, exit code) from ``scontrol show job``; exit code None while not finished."""
        r = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
        state = fields.get("JobState", "UNKNOWN")
        code = fields.get("ExitCode")
        done = state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")
        return state, (int(code.split(":")[0]) if done and code else None)

    def wait(self, job_ids: list[int], timeout: float) -> dict[int, tuple[str, int]]:
        """Wait until every job has finished; cancels the rest and raises TimeoutError after ``timeout`` s."""
        deadline = time.time() + timeout
        result: dict[int, tuple[str, int]] = {}
        while time.time() < deadline:
            for j in job_ids:
                if j not in result:
                    state, code = self.job_state(j)
                    if code is not None:
                        result[j] = (state, code)
            if len(result) == len(job_ids):
                return result
            time.sleep(2)
        self.run(["scancel", *map(str, job_ids)], check=False)
        raise TimeoutError(f"jobs {sorted(set(job_ids) - set(result))} still running after {timeout:.0f} s")

    def logs_tail(self, n: int = 2000) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace")
            if text.strip():
                out.append(f"--- {f.name}\n{text[-n:]}")
        return "\n".join(out)

    # ------------------------------------------------------------------ tear-down
    def stop(self) -> None:
        """Cancel every job, then stop the daemons (our children) by pid: TERM, then KILL after 15 s; remove
        the cluster's temp dir (call :meth:`logs_tail` before, for the logs)."""
        if any(p.poll() is None for p in self.procs):
            self.run(["scancel", "--full", "--user", str(os.geteuid())], check=False, timeout=30)
            deadline = time.time() + 30
            while time.time() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(1)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 15
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    import sys

    reason = ensure_slurm_installed()
    if reason:
        sys.exit(f"cannot run Slurm here: {reason}")
    cluster = LocalSlurm(nodes=int(sys.argv[1]) if len(sys.argv) > 1 else 2).start()
    print(f"export SLURM_CONF={cluster.conf}\n" + cluster.run(["sinfo"]).stdout, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        cluster.stop()
