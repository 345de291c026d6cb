"""Shared by the benchmarks: re-launch a benchmark script under torchrun and relay its output."""
import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def relay(script: str, argv: list, result_prefix: str, nproc: int = 2) -> None:
    """Run ``torchrun --nproc_per_node=nproc script *argv`` on a free local port, print its output (warnings
    dropped) and end with its result line (the last line starting with `result_prefix`); exit non-zero with
    "benchmark failed (exit code N)" when the run fails or prints no result.  The run gets its own process
    group, killed at the end (engine / Ray leftovers of a failed run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # a shared machine often sits above Ray's default 95% memory threshold, where Ray kills the engine actor
    env.setdefault("RAY_memory_usage_threshold", "0.99")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           os.path.abspath(script), *argv]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    result, rc = None, None
    try:
        for line in proc.stdout:
            if line.startswith(result_prefix):
                result = line.strip()
            elif "Warning" not in line and "warnings.warn" not in line:
                sys.stdout.write(line)
                sys.stdout.flush()
        rc = proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if rc != 0 or result is None:
        print(f"benchmark failed (exit code {rc})", flush=True)
        sys.exit(rc or 1)
    print(result, flush=True)
