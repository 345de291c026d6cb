"""Profiling of chosen training steps: verl's ``global_profiler`` section (``trainer.profile_steps`` is read as
``global_profiler.steps``).

    global_profiler.steps: [1, 5, 10]   the steps profiled (1-based training steps; null: none)
    global_profiler.tool: null          null or torch: torch.profiler traces; nsys: Nsight Systems capture
    global_profiler.save_path: null     where traces go; null: <trainer.default_local_dir>/profile

torch (or null): each listed step runs under ``torch.profiler.profile`` (CPU activity, and CUDA on a CUDA
device) and every rank writes one Chrome trace per profiled step,
``<save_path>/global_step_<k>/rank_<r>.pt.trace.json`` (``Profile.export_chrome_trace``): Perfetto
(ui.perfetto.dev), chrome://tracing and TensorBoard's PyTorch profiler plugin (torch-tb-profiler, pointed at
``<save_path>``) read it.  Other steps run without a profiler.

Under Nsight Systems on a CUDA device (``nsys profile`` sets ``NSYS_PROFILING_SESSION_ID`` in the processes it
profiles) every step is an NVTX range ``step_<k>`` and every timed phase (``timing_s/<phase>``,
rlhf.trainer.metrics.timer) a range ``<phase>`` inside it; with ``tool=nsys`` the listed steps are also bracketed
by ``torch.cuda.profiler.start()`` / ``stop()``, for ``nsys profile --capture-range=cudaProfilerApi``.  Outside
nsys, or on the CPU, no NVTX call is made.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, Mapping, Optional, Sequence

import torch

__all__ = ["StepProfiler", "under_nsys", "nvtx_range", "trace_path", "NSYS_ENV"]

logger = logging.getLogger(__name__)

#: set by nsys in every process it profiles
NSYS_ENV = "NSYS_PROFILING_SESSION_ID"
_nvtx_on = False  # NVTX ranges are emitted (under nsys, on a CUDA device); set by StepProfiler


def under_nsys(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when this process runs under Nsight Systems (:data:`NSYS_ENV` is set)."""
    return bool((os.environ if environ is None else environ).get(NSYS_ENV))


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX range `name` around the block when NVTX is on (see the module docstring), else nothing."""
    if not _nvtx_on:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def trace_path(save_path: str, step: int, rank: int) -> str:
    """``<save_path>/global_step_<step>/rank_<rank>.pt.trace.json``: the trace of one profiled step of one rank."""
    return os.path.join(save_path, f"global_step_{step}", f"rank_{rank}.pt.trace.json")


class StepProfiler:
    """Profiles the listed `steps` of a run (module docstring).

    Args:
        steps: training steps to profile (1-based); empty or None: none.
        save_path: the traces' directory.
        rank: this process's global rank (in the file name).
        device: the device this rank trains on (CUDA activity and NVTX only for a CUDA device).
        tool: None or "torch" (torch.profiler traces), or "nsys" (capture range only, no trace files).
        environ: the environment to look for nsys in (default os.environ).

    Raises:
        ValueError: an unknown `tool`.
    """

    def __init__(self, steps: Optional[Sequence[int]], save_path: str, rank: int, device: torch.device,
                 tool: Optional[str] = None, environ: Optional[Mapping[str, str]] = None):
        if tool not in (None, "torch", "nsys"):
            raise ValueError(f"global_profiler.tool={tool!r}: use torch (traces) or nsys, or null (torch)")
        self.steps = frozenset(int(s) for s in steps or ())
        self.save_path, self.rank, self.tool = save_path, rank, tool or "torch"
        self.cuda = torch.device(device).type == "cuda"
        self.nvtx = self.cuda and under_nsys(environ)

    @classmethod
    def from_config(cls, cfg, rank: int, device: torch.device) -> "StepProfiler":
        """From the config's ``global_profiler`` section (save_path null: ``<trainer.default_local_dir>/profile``)."""
        p = cfg.global_profiler
        save_path = p.save_path or os.path.join(cfg.trainer.default_local_dir, "profile")
        steps = list(p.steps) if p.steps is not None else None
        return cls(steps, save_path, rank, device, tool=None if p.tool is None else str(p.tool))

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run training step `step` (1-based) under the profiler when it is listed; an NVTX range under nsys."""
        global _nvtx_on
        _nvtx_on = self.nvtx
        profiled = step in self.steps
        with nvtx_range(f"step_{step}"):
            if not profiled:
                yield
            elif self.tool == "nsys":
                with self._capture_range():
                    yield
            else:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if self.cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
                    yield
                path = trace_path(self.save_path, step, self.rank)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                prof.export_chrome_trace(path)
                if self.rank == 0:
                    logger.info("profiler: step %d trace written to %s", step, path)

    @contextlib.contextmanager
    def _capture_range(self) -> Iterator[None]:
        if self.cuda:
            torch.cuda.profiler.start()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.profiler.stop()

    def close(self) -> None:
        """Stop emitting NVTX ranges (the run is over)."""
        global _nvtx_on
        _nvtx_on = False
