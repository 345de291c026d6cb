"""Fully asynchronous training (``async_training.enable``; verl's verl/experimental/fully_async_policy with its keys
``staleness_threshold``, ``trigger_parameter_sync_step``, ``require_batches``, ``partial_rollout``,
``use_rollout_log_probs``): a rollouter thread on rank 0 streams prompt groups through the engines (Ray actors, their
own processes) into a queue while the trainer trains; each trainer step takes ``B = require_batches x
actor.ppo_mini_batch_size`` finished groups (``rollout.n`` samples each), in the order they finished.

* Weight syncs: every ``trigger_parameter_sync_step`` actor updates (and before validation) the rollouter pauses, the
  actor's weights go to the engines (a collective), the rollouter continues with the new version.
* Freshness (verl's rule): between two syncs the rollouter admits at most ``(1 + staleness_threshold) x
  trigger_parameter_sync_step x B`` groups minus those drawn and not yet trained at the sync, so the queue is bounded
  and ``staleness_threshold: 0`` is on-policy (nothing is generating at a sync).
* Partial rollout: the rollouter generates in chunks of ``partial_rollout_chunk_tokens`` tokens per request (SGLang
  0.5.23's offline ``Engine`` has no pause/continue, which its PauseGenerationReqInput documents as server-only; a
  request in flight is "paused" at its next chunk boundary); a sync pauses at the end of the chunk in flight and the
  unfinished requests continue from prompt + response so far on the new weights.  Every token keeps the engine's
  log-prob and the weight version it was sampled with (``sample.extra["token_weight_versions"]``); without
  ``partial_rollout`` a request is one chunk (a sync waits for the requests in flight, as verl's mode c).
* Multi-turn (``rollout.multi_turn``): the rollouter runs the agent loop (rlhf.agent.loop) for the groups it
  admitted (new groups are admitted when those trajectories are done); every engine call of the loop goes through
  :meth:`FullyAsync._agent_generate`.  With ``partial_rollout`` a sync pauses the trajectories at their next engine
  call (a turn, or a chunk of one) and they continue on the new weights, so a trajectory's turns may span weight
  versions (each model token keeps its log-prob and version; tool / user tokens: response_mask 0, the version of
  the model token before them); without it the trajectories in flight finish before the sync (drained).
* Staleness per sample: actor version at training minus the version its first token was sampled with:
  ``async/staleness/{mean,max,min}``, ``async/num_stale_samples``, ``async/weight_version``; verl's
  ``fully_async/partial/{total_partial_num,partial_ratio,max_partial_span}`` (samples whose tokens span several
  versions) and ``fully_async/count/{total_generated_samples,stale_samples_processed,current_param_version}``.
* Engine deaths: when no fresh engine is left (the only one died, or all did: ``StaleEnginesError``), the
  rollouter keeps the samples that finished, pauses and hands the replaced engines to the trainer, which syncs them
  at its next safe point (:meth:`FullyAsync.next_round`, the main thread of every rank: the rollouter thread never
  issues a collective) -- with the actor's weights when they are still the engines' version, else with a full weight
  sync -- then the rollouter continues the unfinished requests (multi-turn: the trajectories wait at their engine
  call).  Counted in ``fully_async/count/engine_resyncs``, logged once.
* Checkpoints (drained): the prompts drawn and not yet trained (queued, generating, or waiting) are saved with the
  prompt loader's position after the last draw; a resumed run generates them first, afresh from the resumed
  weights, so no prompt is trained twice or lost.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

from rlhf.rollout.types import FINISH_LENGTH, RolloutSample

from .metrics import timer
from .one_step_off import staleness_metrics

log = logging.getLogger(__name__)

__all__ = ["FullyAsync", "Group", "admission_cap"]


def admission_cap(cfg_async, mini_batch: int, carried: int) -> int:
    """verl's freshness bound: groups the rollouter may admit between two syncs, ``floor((1 + staleness_threshold) x
    trigger_parameter_sync_step x require_batches x mini_batch) - carried`` (``carried``: drawn, not yet trained at
    the sync).  E.g. 0.5, 2, 1, 4 with 3 carried: floor(1.5 x 8) - 3 = 9."""
    per_sync = cfg_async.trigger_parameter_sync_step * cfg_async.require_batches * mini_batch
    return int((1.0 + float(cfg_async.staleness_threshold)) * per_sync + 1e-9) - carried


@dataclass
class Request:
    """One sample being generated: prompt, response so far, the engine's log-prob and weight version per token."""
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    log_probs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    extra: dict = field(default_factory=dict)

    def extend(self, out, version: int, max_len: int) -> bool:
        """Append one generate call's continuation ``out`` (a RolloutSample) made by weights ``version``; true when
        that finished the request (a stop, or ``max_len`` response tokens), whose finish_reason it then takes."""
        self.response_ids += list(out.response_ids)
        self.log_probs += list(out.response_log_probs)
        self.versions += [version] * len(out.response_ids)
        self.extra.update(out.extra)
        if out.finish_reason != FINISH_LENGTH or len(self.response_ids) >= max_len:
            self.finish_reason = out.finish_reason
            return True
        return False


@dataclass
class Group:
    """One prompt (its loader row: input_ids_list, data_source, ground_truth, extra_info, index, raw_prompt) and
    its ``rollout.n`` requests; ``uid``: draw order."""
    uid: int
    row: dict
    requests: list
    start_version: int = 0

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.requests)


class FullyAsync:
    """The module docstring's pipeline for one trainer.  `rollout`: the trainer's RolloutWorker (``rank0``,
    ``manager``, ``train_sampling``, ``host_group``, ``sync_weights``, ``ensure_resident``); `loader`: its prompt
    loader (rank 0 draws); `finish(step, batch, started) -> (samples, scores, rewards, metrics)`: the trainer's
    collective scoring of a batch whose samples `started` holds; `seed_of(k)`: the sampling seed of the rollouter's
    k-th generate call; `total_steps`: no prompt is drawn past ``total_steps x B``."""

    def __init__(self, cfg, rollout, loader, finish: Callable, seed_of: Callable[[int], int], total_steps: int):
        self.a = cfg.async_training
        self.B = int(self.a.require_batches) * int(cfg.actor.ppo_mini_batch_size)
        self.n, self.max_len = int(cfg.rollout.n), int(cfg.data.max_response_length)
        chunk = self.a.partial_rollout_chunk_tokens or max(1, self.max_len // 4)
        self.chunk = chunk if self.a.partial_rollout else self.max_len
        self.rollout, self.loader, self.finish, self.seed_of = rollout, loader, finish, seed_of
        self.total_groups = total_steps * self.B
        self.rank0 = rollout.rank0
        self.actor_version = self.engine_version = 0
        # rank 0's rollouter state, under self.cond
        self.cond = threading.Condition()
        self.waiting: deque = deque()  # rows drawn, not admitted (a resumed run's pending rows first)
        self.active: list = []  # admitted groups, generating
        self.finished: deque = deque()  # the queue: finished groups, in the order they finished
        self.next_uid = 0
        self.consumed = 0  # groups trained (restored on resume)
        self.admitted = 0  # since the last sync
        self.cap = admission_cap(self.a, cfg.actor.ppo_mini_batch_size, 0)
        self.generated = 0  # samples generated (fully_async/count/total_generated_samples)
        self.stale_processed = 0
        self.pause_wanted = self.paused = self.stop = False
        self.resync_wanted = False  # the rollouter found no fresh engine: replaced engines wait for a sync
        self.engine_resyncs = 0  # times the rollouter handed replaced engines back for a sync
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.calls = 0
        # rollout.multi_turn: rank 0's agent loop (rlhf.agent.loop.AgentLoop) generates the groups; a shallow copy
        # (same tools), so that validation's agent run, while the rollouter is paused mid-round, has its own counters
        agent = getattr(rollout, "agent", None) if cfg.rollout.multi_turn.enable else None
        self.agent = copy.copy(agent) if agent is not None else None
        if self.agent is not None:
            self.agent.renderer = copy.copy(agent.renderer)  # (its fallback counter)

    # ---- what the trainer calls -------------------------------------------------------------------
    def next_round(self, step: int) -> tuple:
        """Collective.  The next B finished groups, scored: (samples, scores, rewards, metrics) with the staleness
        metrics and ``timing_s/gen`` (the wait for them and their reward)."""
        m: dict = {}
        self._start_or_resume()
        with timer(m, "gen"):
            while True:  # None: the rollouter handed replaced engines back; every rank re-syncs them, then waits on
                batch, started = self._take() if self.rank0 else (None, None)
                if (batch := _bcast(batch, self.rollout.host_group)) is not None:
                    break
                self._resync_replaced(m)
            samples, scores, rewards, gen_metrics = self.finish(step, batch, started)
        m.update(gen_metrics)
        generated, resyncs = _bcast((self.generated, self.engine_resyncs) if self.rank0 else None,
                                    self.rollout.host_group)
        first = [s.extra["weight_version"] for s in samples]
        last = [max(s.extra["token_weight_versions"] or [v]) for s, v in zip(samples, first)]
        m.update(staleness_metrics(self.actor_version, first))
        spans = [b - a for a, b in zip(first, last)]
        partial = sum(1 for d in spans if d > 0)
        self.stale_processed += sum(1 for v in first if v < self.actor_version)
        m.update({"fully_async/partial/total_partial_num": float(partial),
                  "fully_async/partial/partial_ratio": partial / max(len(spans), 1),
                  "fully_async/partial/max_partial_span": float(max(spans, default=0)),
                  "fully_async/count/stale_samples_processed": float(self.stale_processed),
                  "fully_async/count/current_param_version": float(self.engine_version),
                  "fully_async/count/engine_resyncs": float(resyncs),
                  "fully_async/count/total_generated_samples": float(generated)})
        if self.rank0:
            log.info("fully async: step %d trains prompts %s (first-token weight versions %s, actor version %d)",
                     step, batch["index"], sorted(set(first)), self.actor_version)
        return samples, scores, rewards, m

    def actor_updated(self, m: Optional[dict] = None) -> None:
        """Collective.  The actor's weights changed; every trigger_parameter_sync_step updates they go to the
        engines (the rollouter paused at a chunk boundary meanwhile)."""
        self.actor_version += 1
        if self.actor_version - self.engine_version >= self.a.trigger_parameter_sync_step:
            self._sync(m if m is not None else {})

    def quiesce(self, metrics: Optional[dict] = None) -> None:
        """Collective.  Pause the rollouter and sync the current actor into the engines (before validation); the
        next :meth:`next_round` resumes it."""
        self._sync(metrics if metrics is not None else {}, resume=False)

    def checkpoint_state(self) -> tuple:
        """(the prompt loader's position, :meth:`state_dict`), taken together under the rollouter's lock (a draw in
        between would save rows twice)."""
        with self.cond:
            return self.loader.state_dict(), self.state_dict()

    def state_dict(self) -> dict:
        """``actor_version``, ``consumed`` and ``pending``: the rows drawn and not yet trained, in draw order."""
        with self.cond:
            groups = sorted([*self.active, *self.finished], key=lambda g: g.uid)
            pending = [g.row for g in groups] + list(self.waiting)
            if self.rank0:
                log.info("fully async: checkpoint keeps pending prompts %s", [r["index"] for r in pending])
            return {"actor_version": self.actor_version, "consumed": self.consumed, "pending": pending}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """After a resume (the trainer has synced the loaded actor into the engines): pending rows go first."""
        state = state or {}
        self.actor_version = self.engine_version = int(state.get("actor_version", 0))
        self.consumed = int(state.get("consumed", 0))
        self.waiting = deque(state.get("pending", []))
        # the pending rows are generated again from the resumed weights: nothing is carried, a whole window to admit
        self.cap, self.admitted = admission_cap(self.a, self.B // self.a.require_batches, 0), 0
        if self.rank0 and self.waiting:
            log.info("fully async: resumed with pending prompts %s", [r["index"] for r in self.waiting])

    def close(self) -> None:
        """Stop the rollouter (after its generate call in flight)."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=300)

    # ---- trainer side ---------------------------------------------------------------------------
    def _start_or_resume(self) -> None:
        if self.thread is None:
            self.rollout.ensure_resident()  # collective: the engines hold their memory from now on
            if self.rank0:
                self.thread = threading.Thread(target=self._run, name="fully-async-rollouter", daemon=True)
                self.thread.start()
        with self.cond:
            self.pause_wanted = False
            self.cond.notify_all()

    def _take(self) -> tuple:
        """Rank 0: wait for B finished groups; their prompt batch (the loader's columns) and a done Future of their
        samples (``prompt_index``: the group's place in the batch).  (None, None) when the rollouter waits for
        replaced engines to be synced first (:meth:`_resync_replaced`)."""
        with self.cond:
            while len(self.finished) < self.B and self.error is None and not self.resync_wanted:
                self.cond.wait(timeout=1.0)
            if self.error is not None:
                raise RuntimeError("fully async: the rollouter failed") from self.error
            if self.resync_wanted:
                return None, None
            groups = [self.finished.popleft() for _ in range(self.B)]
            self.consumed += len(groups)
            self.cond.notify_all()
        batch = {k: [g.row[k] for g in groups] for k in groups[0].row}
        samples = [RolloutSample(prompt_ids=r.prompt_ids, response_ids=r.response_ids, response_log_probs=r.log_probs,
                                 finish_reason=r.finish_reason, prompt_index=i, sample_index=j,
                                 weight_version=r.versions[0] if r.versions else g.start_version,
                                 extra={**r.extra, "weight_version": r.versions[0] if r.versions else g.start_version,
                                        "token_weight_versions": list(r.versions)})
                   for i, g in enumerate(groups) for j, r in enumerate(g.requests)]
        started: Future = Future()
        started.set_result(samples)
        return batch, started

    def _sync(self, m: dict, resume: bool = True) -> None:
        """Collective.  Pause the rollouter (rank 0: at the end of its generate call in flight), push the actor's
        weights when they changed, reset the admission budget, resume unless `resume` is false."""
        if self.rank0 and self.thread is not None:
            with timer(m, "pause_rollouter"), self.cond:  # timing_s/pause_rollouter: the wait for the chunk in flight
                self.pause_wanted = True
                self.cond.notify_all()
                while not self.paused and self.error is None and self.thread.is_alive():
                    self.cond.wait(timeout=1.0)
        if self.engine_version != self.actor_version:
            with timer(m, "update_weights"):
                m.update(self.rollout.sync_weights().metrics())
            self.engine_version = self.actor_version
            with self.cond:
                carried = len(self.active) + len(self.finished)  # admitted, not trained (waiting rows are not)
                self.cap, self.admitted = admission_cap(self.a, self.B // self.a.require_batches, carried), 0
                self.resync_wanted = False  # sync_weights re-synced replaced engines too
        if resume:
            with self.cond:
                self.pause_wanted = False
                self.cond.notify_all()

    def _resync_replaced(self, m: dict) -> None:
        """Collective, the trainer's main thread (the rollouter waits, paused): the engines replaced after a crash
        get the actor's weights -- those alone when the actor is still the engines' version, else every engine (a
        weight sync, the version moves on: the engines serve one version) -- then the rollouter continues."""
        if self.engine_version != self.actor_version:
            self._sync(m)
        else:  # (its time counts in timing_s/gen)
            self.rollout.resync_replaced()
        with self.cond:
            self.resync_wanted = False
            self.cond.notify_all()

    # ---- the rollouter (rank 0's thread) ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stop and (self.pause_wanted or self.resync_wanted or not self._admit()):
                        self.paused = True
                        self.cond.notify_all()
                        self.cond.wait(timeout=1.0)
                    self.paused = False
                    if self.stop:
                        return
                    todo = [(g, r) for g in self.active for r in g.requests if r.finish_reason is None]
                    version = self.engine_version
                if self.agent is not None:
                    if self._run_agent(list(self.active)):
                        return
                else:
                    self._generate_chunk(todo, version)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            log.exception("fully async: the rollouter failed")
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _admit(self) -> bool:
        """Under the lock: admit waiting / newly drawn groups within the budget; true when something is active."""
        in_system = self.consumed + len(self.finished) + len(self.active)
        while self.admitted < self.cap and in_system < self.total_groups and len(self.active) < self.B:
            if not self.waiting:
                batch = self.loader.next_batch()
                self.waiting.extend({k: batch[k][i] for k in batch} for i in range(len(batch["index"])))
            row = self.waiting.popleft()
            reqs = [Request(prompt_ids=list(row["input_ids_list"])) for _ in range(self.n)]
            self.active.append(Group(self.next_uid, row, reqs, self.engine_version))
            self.next_uid += 1
            self.admitted += 1
            in_system += 1
        return bool(self.active)

    def _generate_chunk(self, todo: list, version: int) -> None:
        """One generate call: each unfinished request continues for up to ``chunk`` tokens from prompt + response
        so far (n = 1 each, its own seed); finished groups go to the queue.  No fresh engine left
        (StaleEnginesError): the samples that finished count, the others continue after the trainer's re-sync."""
        from rlhf.rollout import StaleEnginesError  # (the manager module imports the engine's)

        sampling = self.rollout.train_sampling
        prompts = [r.prompt_ids + r.response_ids for _, r in todo]
        budget = min(self.chunk, min(self.max_len - len(r.response_ids) for _, r in todo))
        sampling = dataclasses.replace(sampling, n=1, max_new_tokens=max(budget, 1), seed=self.seed_of(self.calls))
        self.calls += 1
        try:
            outs, stale = self.rollout.manager.generate(prompts, sampling), None
        except StaleEnginesError as e:  # prompt_index: the request's place in todo (n = 1)
            outs, stale = [None] * len(todo), e.engines
            for out in e.samples:
                outs[out.prompt_index] = out
        with self.cond:
            for (g, r), out in zip(todo, outs):
                if out is not None and r.extend(out, version, self.max_len):
                    self.generated += 1
            for g in [g for g in self.active if g.done]:
                self.active.remove(g)
                self.finished.append(g)
            if stale:
                self._hand_back(stale)
            self.cond.notify_all()

    def _hand_back(self, engines: list) -> None:
        """Under the lock: no fresh engine left; the rollouter waits until the trainer re-synced ``engines``
        (:meth:`_resync_replaced`).  Counted, logged once."""
        self.resync_wanted, self.engine_resyncs = True, self.engine_resyncs + 1
        if self.engine_resyncs == 1:
            log.warning("fully async: rollout engine(s) %s replaced after a crash, no fresh engine left: the rollouter "
                        "pauses until the trainer syncs them (counted in fully_async/count/engine_resyncs; logged "
                        "once)", engines)
        self.cond.notify_all()

    # ---- multi-turn: the agent loop in the rollouter -------------------------------------------------
    def _run_agent(self, groups: list) -> bool:
        """The agent loop's ``rollout.n`` trajectories for each of ``groups`` (their prompts rendered by its chat
        template); done groups go to the queue.  True when :meth:`close` stopped it meanwhile."""
        rows = [{"raw_prompt": g.row["raw_prompt"], "extra_info": g.row["extra_info"],
                 "ground_truth": g.row["ground_truth"]} for g in groups]
        sampling = dataclasses.replace(self.rollout.train_sampling, n=self.n)
        try:
            samples, _ = self.agent.run(self._agent_generate, rows, sampling)
        except _Stopped:
            return True
        with self.cond:
            for s in samples:
                versions = list(s.extra["token_weight_versions"])
                groups[s.prompt_index].requests[s.sample_index] = Request(
                    list(s.prompt_ids), list(s.response_ids), list(s.response_log_probs), versions, s.finish_reason,
                    {k: v for k, v in s.extra.items() if k != "token_weight_versions"})
                self.generated += 1
            for g in groups:
                self.active.remove(g)
                self.finished.append(g)
            self.cond.notify_all()
        return False

    def _agent_generate(self, prompts: list, sampling) -> list:
        """The fleet's ``generate(prompt_ids_list, sampling) -> [RolloutSample]`` for the agent loop (one request
        per prompt, ``sampling.n`` = 1).  With ``partial_rollout`` each call is paused while a sync is wanted (the
        trajectories wait at this turn boundary) and generates in chunks of ``partial_rollout_chunk_tokens`` with the
        same pause between chunks; each sample's ``extra["token_weight_versions"]``: the version of every token.
        No fresh engine left (StaleEnginesError): the finished requests count, the others wait here for the trainer's
        re-sync (:meth:`_hand_back`) and continue.  Raises _Stopped after :meth:`close`."""
        from rlhf.rollout.manager import StaleEnginesError

        want = sampling.max_new_tokens
        reqs = [Request(prompt_ids=list(p)) for p in prompts]
        while True:
            todo = [r for r in reqs if r.finish_reason is None]
            if not todo:
                break
            with self.cond:
                while ((self.a.partial_rollout and self.pause_wanted) or self.resync_wanted) and not self.stop:
                    self.paused = True
                    self.cond.notify_all()
                    self.cond.wait(timeout=1.0)
                self.paused = False
                if self.stop:
                    raise _Stopped()
                version = self.engine_version
            budget = min(self.chunk, min(want - len(r.response_ids) for r in todo))
            chunk = dataclasses.replace(sampling, n=1, max_new_tokens=max(budget, 1), seed=self.seed_of(self.calls))
            self.calls += 1
            try:
                outs = self.rollout.manager.generate([r.prompt_ids + r.response_ids for r in todo], chunk)
            except StaleEnginesError as e:  # prompt_index: the request's place in todo (n = 1)
                outs = [None] * len(todo)
                for out in e.samples:
                    outs[out.prompt_index] = out
                with self.cond:
                    self._hand_back(e.engines)
            for r, out in zip(todo, outs):
                if out is not None:
                    r.extend(out, version, want)
        return [RolloutSample(prompt_ids=r.prompt_ids, response_ids=r.response_ids, response_log_probs=r.log_probs,
                              finish_reason=r.finish_reason, prompt_index=i, sample_index=0,
                              weight_version=r.versions[0] if r.versions else version,
                              extra={**r.extra, "token_weight_versions": list(r.versions)})
                for i, r in enumerate(reqs)]


class _Stopped(Exception):
    """The rollouter was closed while the agent loop waited for the engines."""


def _bcast(obj, group):
    """Rank 0's ``obj`` on every rank of ``group``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
