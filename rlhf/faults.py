"""Fault injection for the fault-tolerance tests: kill the run at a named point, as a crash would.

    RLHF_FAULT=<point>[@<hit>][,<point>[@<hit>] ...]       e.g. RLHF_FAULT=ckpt_before_rename@2

The `hit`-th time (default 1) this process reaches ``maybe_fail(<point>)``, it logs one warning
``FAULT <point> hit <n> ...: SIGKILL process group <pgid>`` (stderr) and sends SIGKILL to its whole
process group (the trainer, torchrun and its ranks, and every child that did not leave the group),
like ``kill -9 -<pgid>`` from a job scheduler or the OOM killer of a container.  Nothing runs after it:
no ``finally``, no atexit hook.  ``RLHF_FAULT_RANK`` (default 0) is the global rank that fires (torchrun's
RANK, Slurm's SLURM_PROCID); other ranks never do.  ``RLHF_FAULT_MODE=process`` SIGKILLs this process
alone (what the kernel's OOM killer does: its children must then go by themselves), ``RLHF_FAULT_MODE=exit``
exits it with code 17.

Points (where the call sits):

    step_start          rlhf.trainer.base   before each training step
    ckpt_mid_save       rlhf.trainer.checkpoint    a role's tensor files written, its metadata not yet
    ckpt_before_rename  rlhf.trainer.checkpoint      every file in global_step_<k>.tmp, before the rename
    ckpt_before_tracker rlhf.trainer.checkpoint      renamed, before latest_checkpointed_iteration.txt
    sync_weights        rlhf.weight_bridge.from_tensor  after each bucket delivered to the engines
                        (``last=True`` on a sync's last bucket)

Points that inject an error instead of killing (the safeguards' tests):

    rollout_request_error  rlhf.rollout.sglang_engine  the engine returns this request aborted, with no
                           token (:func:`fires`; counted per engine process, one count per sample)
    reward_model_slow      rlhf.rewards.reward_model   the local reward model's call stalls
                           ``RLHF_FAULT_STALL_S`` seconds (default 10) first (:func:`maybe_stall`)
    sync_convert_error     rlhf.weight_bridge.hf_stream  a stage leader's conversion of a gathered parameter
                           raises (as a CUDA OOM in ``torch.cat`` would), counted per conversion
                           (:func:`fires`)
    rollout_engine_death   rlhf.rollout.manager  as the fleet's generate call starts, engine 0's actor is
                           killed (``ray.kill``: its process and its scheduler are gone, as after an OOM kill),
                           counted per generate call of the firing rank's fleet (:func:`fires`)

Without ``RLHF_FAULT`` every call is a dictionary lookup and returns.
"""
from __future__ import annotations

import logging
import os
import signal
import time

__all__ = ["FAULT_ENV", "POINTS", "maybe_fail", "fires", "maybe_stall", "armed", "parse_spec"]

FAULT_ENV = "RLHF_FAULT"
POINTS = ("step_start", "ckpt_mid_save", "ckpt_before_rename", "ckpt_before_tracker", "sync_weights",
          "rollout_request_error", "reward_model_slow", "sync_convert_error", "rollout_engine_death")
EXIT_CODE = 17  # RLHF_FAULT_MODE=exit

TRACE_ENV = "RLHF_FAULT_TRACE"

#: WARNING: the lines show on every rank and in processes without logging set up (Python's last-resort handler)
logger = logging.getLogger(__name__)

_hits: dict[str, int] = {}
_passes: dict[str, int] = {}  # RLHF_FAULT_TRACE


def parse_spec(spec: str) -> dict[str, int]:
    """``"a@2,b"`` -> {"a": 2, "b": 1}.  Raises ValueError naming an unknown point or a bad hit number."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, hit = part.partition("@")
        if name not in POINTS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: unknown point {name!r}; use one of {list(POINTS)}")
        if hit and not (hit.isdigit() and int(hit) >= 1):
            raise ValueError(f"{FAULT_ENV}={spec!r}: hit {hit!r} of {name!r} must be an integer >= 1")
        out[name] = int(hit or 1)
    return out


def armed(point: str) -> bool:
    """Whether ``RLHF_FAULT`` names `point` for this rank (cheap; for code that prepares a fault point)."""
    spec = os.environ.get(FAULT_ENV)
    return bool(spec) and point in parse_spec(spec) and _this_rank_fires()


def _this_rank_fires() -> bool:
    from rlhf.launch_env import launch_env  # RANK (torchrun) or SLURM_PROCID (srun); 0 when run directly

    return str(launch_env().rank) == os.environ.get("RLHF_FAULT_RANK", "0")


def fires(point: str) -> bool:
    """Count a pass through `point`; True on the configured hit (once per process), else False."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or not _this_rank_fires():
        return False
    target = parse_spec(spec).get(point)
    if target is None:
        return False
    _hits[point] = _hits.get(point, 0) + 1
    return _hits[point] == target


def maybe_stall(point: str) -> None:
    """Count a pass through `point`; on the configured hit, log a FAULT line and sleep
    ``RLHF_FAULT_STALL_S`` seconds (default 10), as a slow service would."""
    if fires(point):
        seconds = float(os.environ.get("RLHF_FAULT_STALL_S", "10"))
        logger.warning("FAULT %s hit %d: stall %g s", point, _hits[point], seconds)
        time.sleep(seconds)


def maybe_fail(point: str, **context) -> None:
    """Count a pass through `point`; on the configured hit, kill the process group (see module docstring).
    `context` (e.g. ``step=3``) is named on the FAULT line.  With ``RLHF_FAULT_TRACE=1`` every pass logs
    ``FAULT-TRACE <point> <n> <context>`` (how a test finds the hit number of a point, e.g. buckets per sync)."""
    where = " ".join(f"{k}={v}" for k, v in context.items())
    if os.environ.get(TRACE_ENV) and _this_rank_fires():
        _passes[point] = _passes.get(point, 0) + 1
        logger.warning("FAULT-TRACE %s %d %s", point, _passes[point], where)
    if not fires(point):
        return
    target = _hits[point]
    mode = os.environ.get("RLHF_FAULT_MODE", "group")
    if mode == "exit":
        logger.warning("FAULT %s hit %d %s: exit %d", point, target, where, EXIT_CODE)
        os._exit(EXIT_CODE)
    if mode == "process":
        logger.warning("FAULT %s hit %d %s: SIGKILL process %d", point, target, where, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
    pgid = os.getpgrp()
    logger.warning("FAULT %s hit %d %s: SIGKILL process group %d", point, target, where, pgid)
    os.killpg(pgid, signal.SIGKILL)
