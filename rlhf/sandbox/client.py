"""Start a local sandbox server and call it (standard library only on the client side).

    with start_local_sandbox() as url:          # "http://127.0.0.1:PORT/run_code"
        resp = run_code(url, "print(1)")        # SandboxFusion's response dict

``local_sandbox_url()`` is the process-wide one the code reward uses for ``sandbox_fusion.url: local``:
started on first use, stopped when the process exits.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, List, Optional

from .server import READY_LINE

__all__ = ["LocalSandbox", "start_local_sandbox", "local_sandbox_url", "run_code", "LOCAL"]

logger = logging.getLogger(__name__)
#: the value of sandbox_fusion.url that means "start a local sandbox"
LOCAL = "local"


class LocalSandbox:
    """A sandbox server in a child process (``python -m rlhf.sandbox.server --port 0 --exit-with-parent``);
    a context manager whose value is the URL of its ``/run_code``.

    Args:
        isolation: auto | namespaces | none (see rlhf.sandbox.isolation).
        max_concurrency: runs at once (None: the server's default).
        start_timeout_s: seconds to wait for the server to listen.

    Raises (on start):
        RuntimeError: the server exited or did not listen in time; the message has its output.
    """

    def __init__(self, isolation: str = "auto", max_concurrency: Optional[int] = None,
                 start_timeout_s: float = 60.0, extra_args: Optional[List[str]] = None):
        self.args = ["--host", "127.0.0.1", "--port", "0", "--isolation", isolation, "--exit-with-parent",
                     *(["--max-concurrency", str(max_concurrency)] if max_concurrency else []), *(extra_args or [])]
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.isolation: Optional[str] = None

    def start(self) -> str:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlhf.sandbox.server", *self.args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines: List[str] = []
        found = threading.Event()

        def read():
            for line in self.proc.stdout:
                if not found.is_set():
                    lines.append(line)
                    if line.startswith(READY_LINE):
                        self.url = line.split()[len(READY_LINE.split())]
                        self.isolation = line.rsplit("isolation: ", 1)[-1].rstrip(")\n")
                        found.set()
                else:
                    logger.info("sandbox: %s", line.rstrip())

        threading.Thread(target=read, daemon=True, name="local-sandbox-log").start()
        deadline = time.monotonic() + self.start_timeout_s
        while not found.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the local sandbox did not start (exit code {self.proc.returncode}): "
                                   f"{''.join(lines)[-3000:]}")
        logger.info("local sandbox at %s (isolation: %s)", self.url, self.isolation)
        return self.url

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def start_local_sandbox(**kwargs) -> LocalSandbox:
    """A :class:`LocalSandbox` (not yet started): ``with start_local_sandbox() as url: ...``."""
    return LocalSandbox(**kwargs)


_LOCAL: Optional[LocalSandbox] = None
_LOCAL_LOCK = threading.Lock()


def local_sandbox_url() -> str:
    """The URL of this process's local sandbox, started on first call and stopped at exit."""
    global _LOCAL
    with _LOCAL_LOCK:
        if _LOCAL is None or _LOCAL.proc is None or _LOCAL.proc.poll() is not None:
            box = LocalSandbox()
            box.start()
            atexit.register(box.close)
            _LOCAL = box
        return _LOCAL.url


def run_code(url: str, code: str, language: str = "python", stdin: Optional[str] = None, run_timeout: float = 10,
             compile_timeout: float = 10, memory_limit_mb: int = 1024, files: Optional[Dict[str, str]] = None,
             fetch_files: Optional[List[str]] = None, http_timeout: Optional[float] = None) -> dict:
    """POST one request (SandboxFusion's body, as verl's call_sandbox_api sends it) and return the response dict.

    Raises:
        urllib.error.URLError / HTTPError: the server cannot be reached or refused the request (422).
    """
    body = json.dumps({"code": code, "language": language, "stdin": stdin, "run_timeout": run_timeout,
                       "compile_timeout": compile_timeout, "memory_limit_MB": memory_limit_mb,
                       "files": files or {}, "fetch_files": fetch_files or []}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    with opener.open(req, timeout=http_timeout or run_timeout + compile_timeout + 30) as r:
        return json.loads(r.read())
