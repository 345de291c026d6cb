"""Math answer equivalence on Hugging Face ``math-verify`` (PyPI ``math-verify``), under a hard time limit.

    math_equal("\\frac{1}{2}", "0.5")      # True
    math_equal("1", "10^{10^{10}}")        # False, after about OP_TIMEOUT_S (2) seconds

Why a child process: math-verify limits its parsing and comparison time with ``signal.alarm``, which works
only in the main thread, and the reward registry scores samples on worker threads (``reward.timeout_s``,
rlhf.rewards.timeout); called there with its time limits, math-verify fails on every sample, and called
without them a pathological answer (``10^{10^{10}}``, ``1000000!``) runs on for minutes, holding the GIL
whenever it is inside C code and stalling every other thread.  So each check runs in a small pool of
child processes (:mod:`rlhf.rewards._math_check_worker`), in their main thread with math-verify's own time
limits, and a child that still has not answered at the hard deadline is killed and replaced.

Pool size: ``RLHF_MATH_WORKERS`` (default ``min(8, cpu count)``, at least 2); workers start on first use
(about a second each: they import sympy) and end when this process exits or closes their input.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from typing import List, Optional

__all__ = ["math_equal", "normalize_answer", "MathCheckPool", "OP_TIMEOUT_S", "HARD_TIMEOUT_S", "MAX_ANSWER_CHARS"]

OP_TIMEOUT_S = 2  # math-verify's own limit (whole seconds) for each parse and for the comparison
HARD_TIMEOUT_S = 5.0  # a worker that has not answered by then is killed; the check counts as not equal
MAX_ANSWER_CHARS = 2000  # longer answers are not parsed (the longest MATH-500 answer has 159 characters)
STARTUP_TIMEOUT_S = 120.0  # a worker's imports (sympy, math-verify); not counted in the check's time

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_check_worker.py")
# the worker runs from ``-c`` with the working directory dropped from sys.path (nothing there may shadow sympy's
# imports) and not as a module of rlhf (no package imports); the parent's sys.path comes with it (PYTHONPATH)
_BOOT = "import runpy, sys; sys.path.pop(0); runpy.run_path(sys.argv[1], run_name='__main__')"


class _Worker:
    """One child process and its pipes."""

    def __init__(self) -> None:
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, env=env, close_fds=True)
        self.buf = b""
        self.next_id = 0
        hello = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        if hello is None or not hello.get("ready"):
            self.kill()
            why = (hello or {}).get("error", f"no answer within {STARTUP_TIMEOUT_S:.0f}s")
            raise RuntimeError(f"math-verify checker process failed to start: {why}. Install it with "
                               "`pip install math-verify==0.9.0`.")

    def _read_line(self, deadline: float) -> Optional[dict]:
        """The next JSON line from the child, or None at the deadline or when the child is gone."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # the child exited
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def ask(self, gold: str, pred: str, op_timeout_s: int, deadline: float) -> Optional[dict]:
        """The child's answer to one check, or None (then the child has been killed)."""
        self.next_id += 1
        req = {"id": self.next_id, "gold": gold, "pred": pred, "t": int(op_timeout_s)}
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.kill()
            return None
        res = self._read_line(deadline)
        if res is None or res.get("id") != req["id"]:
            self.kill()
            return None
        return res

    @property
    def alive(self) -> bool:
        """Whether the child is still running."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kill the child (its input closed first) and reap it."""
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignored
            pass


class MathCheckPool:
    """Up to ``max_workers`` checker processes shared by the threads of this process (see the module doc)."""

    def __init__(self, max_workers: Optional[int] = None):
        if max_workers is None:
            max_workers = int(os.environ.get("RLHF_MATH_WORKERS", 0)) or max(2, min(8, os.cpu_count() or 2))
        if max_workers < 1:
            raise ValueError(f"MathCheckPool: max_workers={max_workers} must be >= 1.")
        self.max_workers = max_workers
        self.pid = os.getpid()
        self._idle: List[_Worker] = []
        self._live = 0
        self._cond = threading.Condition()

    def _acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and self._live >= self.max_workers:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._live += 1
        try:
            return _Worker()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if worker.alive:
                self._idle.append(worker)
            else:
                self._live -= 1
            self._cond.notify()

    def check(self, gold: str, pred: str, op_timeout_s: int = OP_TIMEOUT_S,
              hard_timeout_s: float = HARD_TIMEOUT_S) -> Optional[bool]:
        """Whether math-verify finds ``pred`` equivalent to ``gold``: strings it can parse, such as ``$...$`` or
        ``\\boxed{...}`` (:func:`math_equal` sends ``$answer$``).

        The hard time limit is counted from when a worker takes the check (waiting for a free worker and a
        worker's start-up are not counted).  Returns None when no answer came in time (the worker was
        killed) or the worker died.  Raises RuntimeError when a worker cannot start (math-verify missing).
        """
        worker = self._acquire()
        try:
            res = worker.ask(gold, pred, op_timeout_s, time.monotonic() + hard_timeout_s)
        finally:
            self._release(worker)
        return None if res is None else bool(res.get("eq"))

    def close(self) -> None:
        """Stop the idle workers (a busy one ends when this process exits and its input closes)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for w in idle:
            w.kill()


_POOL: Optional[MathCheckPool] = None
_POOL_LOCK = threading.Lock()


def _pool() -> MathCheckPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # a forked child does not share its parent's pipes
            _POOL = MathCheckPool()
        return _POOL


@atexit.register
def _close_pool() -> None:
    if _POOL is not None and _POOL.pid == os.getpid():
        _POOL.close()


_THIN_SPACE_IN_NUMBER = re.compile(r"(?<=\d)(?:\\[,;:]|\\ )\s*(?=\d{3}(?!\d))")  # 1\,000 -> 1000
_SPACING = re.compile(r"\\[,;:]")  # \, \; \: -> a space
_DOLLAR = re.compile(r"(?<!\\)\$")  # $ that is not \$ (math mode delimiters)


def normalize_answer(s: str) -> str:
    """The answer as given to math-verify: thin spaces inside numbers dropped (math-verify reads ``1\\,000``
    as ``1*000``), other spacing commands and ``\\!`` turned into spaces / dropped, ``\\%`` / ``%`` dropped (as
    verl's MATH normalization ``strip_string`` does: ``50\\%`` == ``50``), ``$`` math delimiters dropped, and every
    run of white space (newlines included) one space: math-verify reads nothing from a matrix written over
    several lines (verl's own PRIME test case ``\\begin{pmatrix}\\n -7 & 6 ...``)."""
    s = _THIN_SPACE_IN_NUMBER.sub("", str(s).strip()).replace("\\!", "")
    s = _SPACING.sub(" ", s).replace("\\%", "").replace("%", "")
    return " ".join(_DOLLAR.sub("", s).split())


def _strip(s: str) -> str:
    return "".join(s.split())


def math_equal(gold: str, pred: str, op_timeout_s: int = OP_TIMEOUT_S,
               hard_timeout_s: float = HARD_TIMEOUT_S) -> bool:
    """Whether the answer ``pred`` is mathematically equivalent to the reference ``gold``.

    Both are the contents of a ``\\boxed{}`` (LaTeX or plain, e.g. ``"\\frac{1}{2}"``, ``"0.5"``,
    ``"(1, 2]"``, ``"10 \\text{ cm}"``); equivalence is Hugging Face math-verify's
    (``verify(parse(gold), parse(pred))``, gold parsed as LaTeX, the prediction as LaTeX or a plain
    expression, as verl's ``verl/utils/reward_score/math_verify.py`` does).  Identical strings (up to
    whitespace) are equal without parsing; an empty answer or one longer than ``MAX_ANSWER_CHARS`` is not.
    Both sides are first normalized by :func:`normalize_answer` (``\\%`` dropped, ``1\\,000`` -> ``1000``).

    Args:
        gold: reference answer.
        pred: the model's answer.
        op_timeout_s: math-verify's own limit for each parse and for the comparison (whole seconds).
        hard_timeout_s: the worker is killed when it has not answered by then.

    Returns:
        True or False; False as well when the check ran out of time or its worker died.

    Raises:
        RuntimeError: math-verify cannot be imported (``pip install math-verify==0.9.0``).
    """
    gold, pred = normalize_answer(gold), normalize_answer(pred)
    if not gold or not pred or len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    if _strip(gold) == _strip(pred):
        return True
    return bool(_pool().check("$" + gold + "$", "$" + pred + "$", op_timeout_s, hard_timeout_s))
