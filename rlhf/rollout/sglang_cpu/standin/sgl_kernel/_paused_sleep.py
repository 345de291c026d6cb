"""A paused CPU scheduler waits for its next message instead of spinning.

Why: SGLang 0.5.23's ``Scheduler.event_loop_overlap`` (and ``event_loop_normal``) handle a paused engine
(``pause_generation``) with ``ingest_requests(); if self._engine_paused: ...; continue`` -- no sleep, so a paused
scheduler busy-polls its sockets at 100% of a core (measured: 1.00 core over 3 s on the tiny quickstart engine,
0.01 when idle and not paused).  On a GPU host a spinning host thread costs little; on a 2-core CPU host it takes
the core the trainer ranks need exactly while they write a sync's weights into the engine's shared parameters
(the zero-copy weight sync pauses generation for that, rlhf/rollout/sglang_engine.py).

The patch ends ``Scheduler._record_scheduler_state_for_paused_engine`` (called on every paused iteration, right
before the ``continue``) with SGLang's own idle wait, ``maybe_sleep_on_idle``: a zmq poll on the scheduler's
input sockets (up to 1 s, returning at once when a message arrives), the same wait an idle unpaused scheduler
does with ``sleep_on_idle`` (rlhf.rollout.sglang_cpu sets it).  Requests still arrive immediately (continue,
end/begin of a weight update, commit); a paused engine runs no batch, so nothing else waits on the loop.  TP ranks
other than 0 have no idle sleeper (SGLang's choice) and block in their broadcast from rank 0 as before.
GPU engines never import this stand-in.
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler"


def patch(module) -> None:
    """Make ``module.Scheduler``'s paused iterations wait on the scheduler's sockets; idempotent."""
    cls = module.Scheduler
    original = cls._record_scheduler_state_for_paused_engine
    if getattr(original, "_rlhf_paused_sleep", False):
        return

    def _record_scheduler_state_for_paused_engine(self):
        original(self)
        self.maybe_sleep_on_idle()

    _record_scheduler_state_for_paused_engine._rlhf_paused_sleep = True
    cls._record_scheduler_state_for_paused_engine = _record_scheduler_state_for_paused_engine


def install() -> None:
    """Patch now when the scheduler module is already imported, else when it is."""
    from ._after_import import after_import

    after_import(TARGET, patch)
