"""The CHECK-line protocol of the torchrun check scripts in this folder: each check is decided collectively and
global rank 0 prints one line ``CHECK <name> PASS|FAIL <detail>`` (read by tests.support.dist_utils.collect_checks,
one line per check, so the detail has no newline).  Every rank must call :func:`report` / :func:`run_check` for every
check, in the same order (they are collectives).  :data:`RESULTS` keeps ``(name, passed)`` of this process's checks,
in order, for a script's final summary."""
from __future__ import annotations

import traceback

import torch.distributed as dist

__all__ = ["RESULTS", "merge_verdicts", "report", "report_rank0", "run_check", "summary"]

RESULTS: list[tuple[str, bool]] = []


def merge_verdicts(verdicts: list[tuple[bool, str]]) -> tuple[bool, str]:
    """Every rank's ``(passed, detail)`` (index = rank) -> ``(all passed, detail)``: the one detail when all ranks
    that give one give the same, else ``rank r: detail`` of each rank that gives one, joined by ``; ``."""
    ok = all(v for v, _ in verdicts)
    details = [(r, d) for r, (_, d) in enumerate(verdicts) if d]
    if len({d for _, d in details}) <= 1:
        return ok, details[0][1] if details else ""
    return ok, "; ".join(f"rank {r}: {d}" for r, d in details)


def _print(name: str, ok: bool, detail: str) -> None:
    if dist.get_rank() == 0:
        print(f"CHECK {name} {'PASS' if ok else 'FAIL'} {detail}".replace("\n", " "), flush=True)


def report(name: str, ok, detail="") -> bool:
    """Collective.  Check `name` passes when it passes on every rank (:func:`merge_verdicts` over an
    all_gather_object); rank 0 prints the line.  Returns the verdict, on every rank."""
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (bool(ok), str(detail)))
    ok, detail = merge_verdicts(verdicts)
    _print(name, ok, detail)
    RESULTS.append((name, ok))
    return ok


def report_rank0(name: str, ok, detail="") -> bool:
    """Collective.  Rank 0's verdict and detail decide check `name` (for checks only rank 0 can judge, e.g. of the
    engines it holds); every rank learns it (broadcast) and gets it back."""
    box = [(bool(ok), str(detail))]
    dist.broadcast_object_list(box, src=0)
    ok, detail = box[0]
    _print(name, ok, detail)
    RESULTS.append((name, ok))
    return ok


def run_check(name: str, fn, *, rank0: bool = False) -> bool:
    """Collective.  ``fn() -> (passed, detail)`` reported as check `name` (:func:`report`, or :func:`report_rank0`
    with `rank0`); an exception in `fn` is a FAIL with its type and message (first 400 characters; the traceback on
    stderr), so that one failing check hides no other and every rank still reaches the report."""
    try:
        ok, detail = fn()
    except Exception as e:  # noqa: BLE001 - one failing check must not hide the others
        traceback.print_exc()
        ok, detail = False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
    return (report_rank0 if rank0 else report)(name, ok, detail)


def summary() -> None:
    """Rank 0 prints ``SUMMARY <passed> passed, <failed> failed`` over :data:`RESULTS`."""
    failed = sum(not ok for _, ok in RESULTS)
    if dist.get_rank() == 0:
        print(f"SUMMARY {len(RESULTS) - failed} passed, {failed} failed", flush=True)
