"""Time limits for reward calls: run functions on daemon threads and abandon the ones that overrun.

Python threads cannot be killed.  A call still running past its limit is abandoned: it keeps
running in the background until it returns, its result is discarded, and nobody waits for it.
Workers are daemon threads, so an abandoned call never keeps the process alive at exit
(``concurrent.futures.ThreadPoolExecutor`` joins its workers at exit and would hang on a reward
function stuck in an infinite loop).  A function that holds the GIL inside C code (e.g.
catastrophic regex backtracking) stalls every thread, so no limit can be enforced for it.

Used by the rule/custom reward path (:func:`rlhf.rewards.registry.compute_scores`, one limit per
sample) and by reward-model sources (:class:`rlhf.rewards.manager.RewardSource`, one limit per
batch).
"""
from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable, Dict, Set, Tuple

__all__ = ["run_with_timeouts", "call_with_timeout"]

_POLL_S = 0.05  # longest wait between deadline checks


class _DaemonPool:
    """Daemon worker threads running ``run(i)`` for i in range(n); a task past ``timeout_s`` (counted
    from its start) is marked timed out and its worker replaced by a fresh one."""

    def __init__(self, run: Callable[[int], Any], n: int, max_workers: int, timeout_s: float):
        self.run, self.n, self.timeout_s = run, n, timeout_s
        self.tasks: "queue.Queue[int]" = queue.Queue()
        for i in range(n):
            self.tasks.put(i)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.start_t: Dict[int, float] = {}
        self.results: Dict[int, Tuple[bool, Any]] = {}
        self.timed_out: Set[int] = set()
        for _ in range(max(1, min(max_workers, n))):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._worker, daemon=True, name="reward-worker").start()

    def _worker(self) -> None:
        while True:
            try:
                i = self.tasks.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                self.start_t[i] = time.monotonic()
            try:
                res: Tuple[bool, Any] = (True, self.run(i))
            except BaseException as e:  # noqa: BLE001 - reported back to the caller
                res = (False, e)
            with self.cond:
                abandoned = i in self.timed_out
                if not abandoned:
                    self.results[i] = res
                self.cond.notify_all()
            if abandoned:
                return  # a replacement worker was already started

    def wait(self) -> Tuple[Dict[int, Tuple[bool, Any]], Set[int]]:
        with self.cond:
            while len(self.results) + len(self.timed_out) < self.n:
                now = time.monotonic()
                next_deadline = math.inf
                for i, t0 in self.start_t.items():
                    if i in self.results or i in self.timed_out:
                        continue
                    deadline = t0 + self.timeout_s
                    if now >= deadline:
                        self.timed_out.add(i)
                        self._spawn()  # replace the stuck worker
                    else:
                        next_deadline = min(next_deadline, deadline)
                if len(self.results) + len(self.timed_out) >= self.n:
                    break
                wait_s = _POLL_S if next_deadline is math.inf else max(0.0, next_deadline - now) + 1e-3
                self.cond.wait(timeout=min(wait_s, _POLL_S))
            return dict(self.results), set(self.timed_out)


def run_with_timeouts(run: Callable[[int], Any], n: int, timeout_s: float, max_workers: int = 8
                      ) -> Tuple[Dict[int, Tuple[bool, Any]], Set[int]]:
    """Run ``run(0) ... run(n - 1)`` on up to ``max_workers`` daemon threads, each call limited to
    ``timeout_s`` seconds from its own start.

    Returns:
        ``(results, timed_out)``: ``results[i] = (True, value)`` or ``(False, exception)`` for every
        call that finished in time; ``timed_out`` the indices of the abandoned calls.

    Raises:
        ValueError: ``timeout_s <= 0`` or ``n < 0``.
    """
    if not timeout_s > 0:
        raise ValueError(f"run_with_timeouts: timeout_s={timeout_s!r} must be > 0.")
    if n < 0:
        raise ValueError(f"run_with_timeouts: n={n} must be >= 0.")
    if n == 0:
        return {}, set()
    return _DaemonPool(run, n, max_workers, float(timeout_s)).wait()


def call_with_timeout(fn: Callable[[], Any], timeout_s: float | None) -> Any:
    """``fn()`` on a daemon thread, abandoned after ``timeout_s`` seconds; ``None``: called directly.

    Raises:
        TimeoutError: no result within ``timeout_s`` (the message names the limit).
        Whatever ``fn`` raised.
    """
    if timeout_s is None:
        return fn()
    results, timed_out = run_with_timeouts(lambda _: fn(), 1, timeout_s, max_workers=1)
    if timed_out:
        raise TimeoutError(f"no result within reward.timeout_s={timeout_s}s")
    ok, value = results[0]
    if not ok:
        raise value
    return value
