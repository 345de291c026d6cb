"""A fault point armed on one rank for a block of a multi-rank check script, under a watchdog (torchrun scripts in
tests/support/dist/: holder_checks.py, bridge_e2e.py)."""
from __future__ import annotations

import contextlib
import os
import threading


@contextlib.contextmanager
def armed_under_watchdog(spec: str, rank: int, name: str, seconds: float):
    """``RLHF_FAULT=spec`` armed on global rank ``rank`` for the block (rlhf.faults' hit counts reset first, disarmed
    after).  A rank still in the block after ``seconds`` prints ``CHECK <name> FAIL ...`` and exits 3: a peer left in
    a collective would otherwise wait for the group's timeout."""
    import torch.distributed as dist

    from rlhf import faults

    def hung():
        print(f"CHECK {name} FAIL rank {dist.get_rank()} still in the sync {seconds} s after the fault on rank {rank} "
              f"(a peer left in a collective)", flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, hung)
    timer.daemon = True
    os.environ.update(RLHF_FAULT=spec, RLHF_FAULT_RANK=str(rank))
    faults._hits.clear()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        for key in ("RLHF_FAULT", "RLHF_FAULT_RANK"):
            os.environ.pop(key, None)
