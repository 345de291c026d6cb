"""Launch torchrun scripts and trainer runs from pytest; parse the scripts' `CHECK name PASS|FAIL detail` lines."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

from tests.support.paths import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str, nproc: int, args: list[str] = (), timeout: int = 900, env: dict | None = None) -> str:
    """Run `torchrun --nproc_per_node=nproc script args` (gloo, CPU); returns combined output.
    A non-zero exit is reported through the missing/failed CHECK lines, with the output tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", script, *args]
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc.stdout + proc.stderr + f"\n[exit code {proc.returncode}]"


_CHECK_LINE = re.compile(r"CHECK (\S+) (PASS|FAIL)(?: (.*))?$")


def collect_checks(output: str) -> dict:
    """{name: (passed, detail)} of the `CHECK name PASS|FAIL detail` lines, plus "_tail" (the output's end).  A line
    is found anywhere in a line of output: another rank's unterminated write can precede it on the same line."""
    checks: dict = {"_tail": output[-6000:]}
    for line in output.splitlines():
        m = _CHECK_LINE.search(line)
        if m:
            checks[m.group(1)] = (m.group(2) == "PASS", m.group(3) or "")
    return checks


def assert_check(checks: dict, name: str) -> None:
    """Fail unless CHECK line `name` ran and passed (`checks` from :func:`collect_checks`); the message carries the
    check's detail, or the output's tail when it never ran."""
    assert name in checks, f"check {name} did not run; output tail:\n{checks.get('_tail', '')}"
    ok, detail = checks[name]
    assert ok, detail


def main_cmd(overrides: list[str], nproc: int = 1) -> list[str]:
    """`python -m rlhf.main overrides` (one process) or the same under torchrun with `nproc` ranks."""
    if nproc == 1:
        return [sys.executable, "-m", "rlhf.main", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", "-m", "rlhf.main", *overrides]


def start_group(cmd: list[str], log, env: dict | None = None) -> subprocess.Popen:
    """Start `cmd` in a process group of its own, stdout and stderr into `log` (a path or an open file: a file, not a
    pipe, so that orphans of a killed run -- dist_checkpointing's manager, Ray agents -- cannot hold the test up).
    The environment is this one plus PYTHONPATH=repo, OMP_NUM_THREADS=1, then `env` (a value None removes the key)."""
    full_env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    out = open(log, "w") if isinstance(log, (str, os.PathLike)) else log
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish_group(proc: subprocess.Popen, timeout: float) -> int | None:
    """Wait up to `timeout` s for the group's leader, then SIGKILL the whole group (whatever it left running);
    returns the exit code, or raises subprocess.TimeoutExpired (the group killed all the same)."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_group(cmd: list[str], timeout: float = 900, env: dict | None = None) -> tuple[int | None, str]:
    """:func:`start_group` + :func:`finish_group` with the output in a temporary file; returns (exit code, output)."""
    with tempfile.TemporaryFile("w+") as log:
        rc = finish_group(start_group(cmd, log, env), timeout)
        log.seek(0)
        return rc, log.read()


@contextlib.contextmanager
def one_rank_grid(store_dir):
    """In this pytest process: a gloo process group of one rank (file store in `store_dir`) with megatron's TP1 x PP1
    grid, torn down on exit (parallel.distributed.destroy_distributed).  Skips the test when a process group exists
    already (another in-process module's)."""
    import pytest
    import torch.distributed as dist

    from parallel.distributed import destroy_distributed, init_model_parallel

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this pytest process")
    dist.init_process_group("gloo", init_method=f"file://{store_dir / 'store'}", rank=0, world_size=1)
    try:
        init_model_parallel(1, 1)
        yield
    finally:
        destroy_distributed()
