"""Run one command isolated (server side of the jail in ``_jail.py``) and report it as SandboxFusion's
``CommandRunResult``: ``{status: Finished | TimeLimitExceeded | Error, execution_time, return_code, stdout,
stderr}``.

Isolation modes (``Isolation(mode=...)``, ``rlhf sandbox serve --isolation``):

* ``namespaces``: new mount / pid / network / ipc / uts namespaces made with ``unshare(2)`` by the jail (Linux,
  root: CAP_SYS_ADMIN; no package to install), everything read-only but the run's folder, the command run as
  its own unprivileged uid with rlimits; see ``_jail.py``;
* ``none``: rlimits, a scrubbed environment, an unprivileged uid when the server is root, a folder of its own;
  no network, file-system or process isolation: only for code you trust;
* ``auto`` (default): ``namespaces`` when a probe run works, else ``none`` with a loud warning (logged and
  reported by ``GET /v1/ping`` and in ``Isolation.fallback``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

__all__ = ["Isolation", "SandboxUnavailable", "ISOLATION_MODES", "MAX_OUTPUT_BYTES"]

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("auto", "namespaces", "none")
_JAIL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jail.py")
#: SandboxFusion keeps the first 1 MiB of stdout and of stderr (sandbox/runners/base.py)
MAX_OUTPUT_BYTES = 1024 * 1024
_KILL_GRACE_S = 2.0


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be set up on this machine (message says why and what to do)."""


@dataclass
class Limits:
    """Per-run limits besides the request's timeouts and memory: processes+threads of the run's uid, bytes of
    one written file, open files; ``max_memory_mb`` caps the request's memory_limit_MB (-1 = this cap)."""
    nproc: int = 64
    fsize_mb: int = 256
    nofile: int = 256
    max_memory_mb: int = 4096


class _UidPool:
    """Unprivileged uids handed out round-robin, one per concurrent run, so that RLIMIT_NPROC (counted per uid)
    limits each run alone and runs cannot touch each other's files or processes."""

    def __init__(self, base: int, count: int):
        self.base, self.count, self.next, self.busy = base, count, 0, set()

    def take(self) -> int:
        for _ in range(self.count):
            uid = self.base + self.next
            self.next = (self.next + 1) % self.count
            if uid not in self.busy:
                self.busy.add(uid)
                return uid
        raise SandboxUnavailable(f"all {self.count} sandbox uids are in use; lower the concurrency")

    def give(self, uid: int) -> None:
        self.busy.discard(uid)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


async def _drain(stream: Optional[asyncio.StreamReader], out: bytearray) -> None:
    while stream is not None and (chunk := await stream.read(65536)):
        out.extend(chunk[: max(0, MAX_OUTPUT_BYTES - len(out))])


async def _feed(stream: Optional[asyncio.StreamWriter], data: Optional[bytes]) -> None:
    if stream is None:
        return
    try:
        if data:
            stream.write(data)
            await stream.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stream.close()


def _exposed_paths() -> List[str]:
    """The interpreter's installation (for ``python`` runs), as real paths."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    return sorted(paths)


class Isolation:
    """Runs commands in per-run folders under ``root`` (a fresh temporary folder by default).

    Args:
        mode: one of ISOLATION_MODES.
        limits: per-run limits (:class:`Limits`).
        uid_base, uid_count: the unprivileged uids used for runs (root only; ignored otherwise).
        max_concurrency: runs at once; the others wait (waiting time is not counted in their timeouts).

    Raises:
        ValueError: unknown ``mode``.
        SandboxUnavailable: ``mode="namespaces"`` and the probe run fails (not root, no namespaces).
    """

    def __init__(self, mode: str = "auto", limits: Optional[Limits] = None, uid_base: int = 900_000,
                 uid_count: int = 1000, max_concurrency: Optional[int] = None, root: Optional[str] = None):
        if mode not in ISOLATION_MODES:
            raise ValueError(f"sandbox isolation={mode!r} is not one of {ISOLATION_MODES}")
        self.limits = limits or Limits()
        self.is_root = os.geteuid() == 0
        self.uids = _UidPool(uid_base, uid_count)
        self.max_concurrency = max_concurrency or max(4, 2 * (os.cpu_count() or 1))
        self._sem: Optional[asyncio.Semaphore] = None
        self.root = root or tempfile.mkdtemp(prefix="rlhf-sandbox-")
        os.chmod(self.root, 0o711)  # runs may enter their own folder, not list the others
        self.requested = mode
        self.mode = "namespaces" if mode != "none" else "none"
        self.fallback: Optional[str] = None
        self.python = sys.executable
        self.env_path = ":".join([os.path.dirname(self.python), "/usr/local/bin", "/usr/bin", "/bin"])
        if mode != "none":
            why = self._probe()
            if why and mode == "namespaces":
                raise SandboxUnavailable(why)
            if why:
                self.mode, self.fallback = "none", why
                logger.warning("LOCAL SANDBOX IS NOT ISOLATED: %s. Runs get rlimits, a scrubbed environment and "
                               "their own folder only (no network / file-system / process isolation); run the "
                               "sandbox as root on Linux for namespaces, or set isolation=namespaces to refuse.",
                               why)

    # ------------------------------------------------------------------ probe

    def _probe(self) -> Optional[str]:
        """None when a namespaced run works here, else why not."""
        if not sys.platform.startswith("linux"):
            return f"namespaces need Linux (this is {sys.platform})"
        if not self.is_root:
            return "namespaces need root (CAP_SYS_ADMIN); the sandbox server runs as uid %d" % os.geteuid()
        res = asyncio.run(self.run([self.python, "-S", "-c", "print('ok')"], timeout=30, memory_mb=512))
        self._sem = None  # made on the probe's event loop
        if res["status"] != "Finished" or res["return_code"] != 0 or res["stdout"] != "ok\n":
            return f"a probe run failed: {res}"
        return None

    # ------------------------------------------------------------------ runs

    def new_folder(self, uid: Optional[int]) -> str:
        """A fresh folder for one run, owned by ``uid`` (mode 0700)."""
        path = tempfile.mkdtemp(dir=self.root, prefix="run-")
        if uid is not None:
            os.chown(path, uid, uid)
        return path

    def take_uid(self) -> Optional[int]:
        return self.uids.take() if self.is_root else None

    def give_uid(self, uid: Optional[int]) -> None:
        if uid is not None:
            self.uids.give(uid)

    def env(self, cwd: str) -> Dict[str, str]:
        """The whole environment of a run: nothing of the server's (its secrets stay out)."""
        return {"PATH": self.env_path, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def memory_bytes(self, memory_mb: Optional[float]) -> int:
        cap = self.limits.max_memory_mb
        mb = cap if memory_mb is None or memory_mb <= 0 else min(float(memory_mb), cap)
        return int(mb * 1024 * 1024)

    async def run(self, argv: Sequence[str], *, timeout: float, memory_mb: Optional[float] = None,
                  stdin: Optional[str] = None, cwd: Optional[str] = None, uid: Optional[int] = None) -> dict:
        """Run ``argv`` in ``cwd`` (a fresh folder, removed afterwards, when None) as ``uid``.

        Returns SandboxFusion's CommandRunResult as a dict: status ``Finished`` (with return_code: the exit code,
        or -N when killed by signal N), ``TimeLimitExceeded`` (wall-clock ``timeout`` seconds passed; the run's
        processes are all killed; return_code None) or ``Error`` (the jail could not run it; stderr says why).
        stdout / stderr: the first MAX_OUTPUT_BYTES of each, decoded as UTF-8 (bad bytes replaced).
        """
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        async with self._sem:
            own_uid = uid is None and cwd is None
            if own_uid:
                uid = self.take_uid()
            folder = cwd or self.new_folder(uid)
            try:
                return await self._run(list(argv), folder, uid, timeout, memory_mb, stdin)
            except Exception as e:  # noqa: BLE001 - a sandbox-side failure is SandboxFusion's "Error"
                logger.exception("sandbox run of %s failed", argv[:1])
                return {"status": "Error", "execution_time": None, "return_code": None, "stdout": None,
                        "stderr": f"sandbox error: {type(e).__name__}: {e}"}
            finally:
                if cwd is None:
                    shutil.rmtree(folder, ignore_errors=True)
                if own_uid:
                    self.give_uid(uid)

    def _spec(self, argv, cwd, uid, timeout, memory_mb, status_fd) -> dict:
        mem = self.memory_bytes(memory_mb)
        cpu = int(math.ceil(timeout)) + 1
        return {"argv": argv, "cwd": cwd, "uid": uid, "gid": uid, "env": self.env(cwd), "status_fd": status_fd,
                "namespaces": self.mode == "namespaces", "expose": _exposed_paths(),
                "limits": {"as": mem, "data": mem, "stack": [min(mem, 1 << 30), min(mem, 1 << 30)],
                           "cpu": [cpu, cpu + 1], "nproc": self.limits.nproc if uid is not None else None,
                           "fsize": self.limits.fsize_mb << 20, "nofile": self.limits.nofile, "core": 0}}

    async def _run(self, argv, cwd, uid, timeout, memory_mb, stdin) -> dict:
        import json

        r, w = os.pipe()
        os.set_blocking(r, False)
        try:
            spec = json.dumps(self._spec(argv, cwd, uid, timeout, memory_mb, w))
            start = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", _JAIL, spec, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, pass_fds=(w,),
                start_new_session=True, env={"PATH": self.env_path}, cwd=cwd)
            os.close(w)
            w = -1
            out, err = bytearray(), bytearray()
            io = asyncio.gather(_feed(proc.stdin, None if stdin is None else stdin.encode()),
                                _drain(proc.stdout, out), _drain(proc.stderr, err), proc.wait())
            timed_out = False
            try:
                await asyncio.wait_for(asyncio.shield(io), timeout=timeout)
            except asyncio.TimeoutError:
                timed_out = True
            elapsed = time.monotonic() - start
            if timed_out or proc.returncode is None:
                _kill(proc.pid)
                try:
                    await asyncio.wait_for(io, timeout=_KILL_GRACE_S)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - output is best effort once killed
                    pass
            status = _read_status(r)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        result = {"status": "Finished", "execution_time": elapsed, "return_code": None, "stdout": _decode(bytes(out)),
                  "stderr": _decode(bytes(err))}
        if timed_out:
            result["status"] = "TimeLimitExceeded"
        elif status.startswith("exit "):
            result["return_code"] = int(status.split()[1])
        elif status.startswith("signal "):
            result["return_code"] = -int(status.split()[1])
        else:
            why = status[len("error "):] if status.startswith("error ") else f"the jail ended without a status " \
                f"(exit code {proc.returncode})"
            result.update(status="Error", stderr=f"sandbox error: {why}\n{result['stderr']}")
        return result


def _kill(pid: int) -> None:
    """SIGKILL the jail's process group; its pid-1 child dies with it (PR_SET_PDEATHSIG), and with pid 1 the
    kernel kills every process of the run's pid namespace."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except ProcessLookupError:
            pass


def _read_status(fd: int) -> str:
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
    except BlockingIOError:
        pass
    return _decode(data).strip()
