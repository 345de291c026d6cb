"""Helper processes that must not outlive the process that started them (Linux).

`die_with_parent(parent_pid)` runs first thing in a child (e.g. as a multiprocessing initializer): the
kernel sends it SIGKILL when the thread that started it exits (prctl PR_SET_PDEATHSIG), however that
parent ends -- SIGKILL included, where no atexit hook or finalizer runs.  Kept free of heavy imports: a
spawned child imports this module only.
"""
from __future__ import annotations

import os
import signal
import sys

__all__ = ["die_with_parent"]

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask for SIGKILL when the parent dies; exit at once when it is already gone.  No-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
