"""Launch torchrun scripts from pytest and parse their `CHECK name PASS|FAIL detail` lines."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


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


def collect_checks(output: str) -> dict:
    checks: dict = {"_tail": output[-6000:]}
    for line in output.splitlines():
        if line.startswith("CHECK "):
            parts = line.split(" ", 3)
            checks[parts[1]] = (parts[2] == "PASS", parts[3] if len(parts) > 3 else "")
    return checks


def assert_check(checks: dict, name: str) -> None:
    """Fail unless CHECK line `name` ran and passed (`checks` from :func:`collect_checks`); the message carries the
    check's detail, or the output's tail when it never ran."""
    assert name in checks, f"check {name} did not run; output tail:\n{checks.get('_tail', '')}"
    ok, detail = checks[name]
    assert ok, detail
