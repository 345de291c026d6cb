"""One-step off-policy training (``trainer.one_step_off_policy``; verl's verl/experimental/one_step_off_policy/
ray_trainer.py): the rollout engines (Ray actors, their own processes) generate batch k+1 while the trainer
trains on batch k; the actor's weights reach the engines at the step boundary, when no generation is running.

    step k:  [nothing in flight: sync the actor's weights, start batch k]
             wait for batch k (finish it collectively: engine replacement, failed samples, reward)
             sync the actor's weights if they changed        (version v_{k-1}; nothing in flight)
             staleness 1: start batch k+1 from them          (RolloutWorker.generate_async: a background thread)
             train on batch k -> v_k                         (no sync here: batch k+1 may be generating)

So with ``staleness: 1`` batch k+1 comes from v_{k-1} and trains the policy v_k: each sample is at most one actor
update old, as in verl.  ``staleness: 0`` starts each batch only after the sync (nothing overlaps): the synchronous
trainer's samples and numbers through the same machinery (tests/e2e/test_async_rl_e2e.py checks this).

Each sample records the weight version it was generated from (``sample.extra["weight_version"]``, the number of
actor updates the engines had received); the step logs ``async/staleness/{mean,max,min}`` (actor version at
training minus the sample's), ``async/weight_version`` (the actor's, before this step's update) and
``async/num_stale_samples``.  Combine with ``algorithm.rollout_correction`` (verl's one-step-off config sets
``bypass_mode: true``) to correct for the older policy.

Validation waits for the batch in flight and syncs the weights first (it validates the current actor).
Checkpoints: the batch in flight is not saved; the prompt loader's state is saved as it was before that batch was
drawn, so a resumed run draws the same prompts again and generates them afresh from the resumed weights (with
the same sampling seed): no prompt is trained twice or lost.  ReMax's greedy baselines are generated when the
batch is collected; DAPO's dynamic sampling is refused with this mode (rlhf.config.validate).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .metrics import timer

log = logging.getLogger(__name__)

__all__ = ["OneStepOff", "InFlight", "staleness_metrics"]


def _ids(prompts: dict) -> list:
    """The dataset indices of a prompt batch (its ``index`` column), for the log lines."""
    return [i.item() if hasattr(i, "item") else i for i in prompts.get("index", [])]


@dataclass
class InFlight:
    """A generation started for `step`: its prompts, rank 0's future, the engines' weight version, and the prompt
    loader's state before its prompts were drawn (what a checkpoint saves)."""
    step: int
    prompts: dict
    started: Any
    weight_version: int
    loader_state: dict


class OneStepOff:
    """The pipeline of the module docstring for one trainer.  `rollout`: the trainer's RolloutWorker; `loader`: its
    StatefulPromptLoader; `finish`: ``finish(step, prompts, started) -> (samples, scores, rewards, metrics)``, the
    trainer's collective generate-and-score of one round (PPOTrainer.generate_round); `seed_of(step)`: the step's
    sampling seed; `total_steps`: no batch is started past it."""

    def __init__(self, cfg, rollout, loader, finish: Callable, seed_of: Callable[[int], int], total_steps: int):
        self.staleness = int(cfg.trainer.one_step_off_policy.staleness)
        self.rollout, self.loader, self.finish, self.seed_of = rollout, loader, finish, seed_of
        self.total_steps = total_steps
        self.inflight: Optional[InFlight] = None
        self.actor_version = 0  # actor updates so far (restored from checkpoints)
        self.engine_version = 0  # the actor version the engines hold
        self.rank0 = rollout.rank0

    # ---- what the trainer calls -------------------------------------------------------------------
    def next_round(self, step: int) -> tuple:
        """Collective.  Batch `step` (samples, scores, rewards, metrics), started now when none is in flight; then
        the weights synced and (staleness 1) batch `step` + 1 started.  The metrics hold the staleness ones,
        ``timing_s/gen`` (the wait for batch `step`; the trainer takes its reward's timing_s/reward out of it) and,
        when a sync ran, ``timing_s/update_weights`` and ``weight_sync/*``."""
        m: dict = {}
        if self.inflight is None:
            self.sync_if_changed(m)
            self.inflight = self._start(step)
        job, self.inflight = self.inflight, None
        if job.step != step:
            raise RuntimeError(f"one-step off-policy: the batch in flight is step {job.step}'s, not step {step}'s")
        if self.rank0:
            log.info("one-step off-policy: step %d trains prompts %s, generated from weight version %d (actor "
                     "version %d)", step, _ids(job.prompts), job.weight_version, self.actor_version)
        with timer(m, "gen"):  # the wait for the batch (and its reward), as verl's one-step-off "gen"
            samples, scores, rewards, gen_metrics = self.finish(step, job.prompts, job.started)
        m.update(gen_metrics)
        self.sync_if_changed(m)
        if self.staleness >= 1 and step < self.total_steps:
            self.inflight = self._start(step + 1)
        for s in samples:
            s.extra["weight_version"] = job.weight_version
        m.update(self.staleness_metrics([job.weight_version] * len(samples)))
        return samples, scores, rewards, m

    def actor_updated(self, m: Optional[dict] = None) -> None:
        """The actor's weights changed (no sync now: a batch may be generating; the next step syncs them)."""
        self.actor_version += 1

    def quiesce(self, metrics: Optional[dict] = None) -> None:
        """Collective.  Wait for the batch in flight (its result is kept for its step) and sync the actor's weights
        into the engines: before validation, which generates with the current actor."""
        if self.inflight is not None and self.inflight.started is not None:
            self.inflight.started.exception()  # wait (an error surfaces when the step collects it)
        self.sync_if_changed(metrics if metrics is not None else {})

    def loader_state(self) -> dict:
        """The prompt loader's state for a checkpoint: before the batch in flight was drawn."""
        return self.inflight.loader_state if self.inflight is not None else self.loader.state_dict()

    def checkpoint_state(self) -> tuple:
        """(the prompt loader's state before the batch in flight, :meth:`state_dict`)."""
        return self.loader_state(), self.state_dict()

    def state_dict(self) -> dict:
        return {"actor_version": self.actor_version}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """After a resume the trainer has synced the loaded actor into the engines."""
        self.actor_version = self.engine_version = int((state or {}).get("actor_version", 0))

    # ---- internals --------------------------------------------------------------------------------
    def sync_if_changed(self, m: dict) -> None:
        """Collective.  Push the actor's weights when the engines hold an older version (nothing in flight)."""
        if self.engine_version == self.actor_version:
            return
        with timer(m, "update_weights"):
            m.update(self.rollout.sync_weights().metrics())
        self.engine_version = self.actor_version

    def _start(self, step: int) -> InFlight:
        """Collective (the engines' memory is ensured on every rank).  Draw batch `step`'s prompts and start them."""
        self.rollout.ensure_resident()
        loader_state = self.loader.state_dict()
        prompts = self.loader.next_batch()
        started = self.rollout.generate_async(prompts, self.rollout.train_sampling, seed=self.seed_of(step))
        if self.rank0:
            log.info("one-step off-policy: started step %d's prompts %s from weight version %d", step, _ids(prompts),
                     self.engine_version)
        return InFlight(step, prompts, started, self.engine_version, loader_state)

    def staleness_metrics(self, versions: list) -> dict:
        return staleness_metrics(self.actor_version, versions)


def staleness_metrics(actor_version: int, versions: list) -> dict:
    """``async/staleness/{mean,max,min}`` (`actor_version` minus each sample's weight version),
    ``async/num_stale_samples`` (staleness >= 1) and ``async/weight_version`` (the actor's, before this step's
    update)."""
    st = torch.tensor([actor_version - v for v in versions], dtype=torch.float32)
    if st.numel() == 0:
        st = torch.zeros(1)
    return {"async/staleness/mean": st.mean().item(), "async/staleness/max": st.max().item(),
            "async/staleness/min": st.min().item(), "async/num_stale_samples": float((st >= 1).sum()),
            "async/weight_version": float(actor_version)}
