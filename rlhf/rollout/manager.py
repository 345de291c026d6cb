"""RolloutManager: ``num_engines`` SGLang engines (Ray actors), driven generically.

* It implements the engine fleet's interface (:class:`rlhf.rollout.engine.EngineFleet`): each method fans the
  :class:`~rlhf.rollout.sglang_engine.SGLangEngine` method of the same name out to all (or some) engines.
* An engine whose actor dies (SGLang's scheduler failed, the process was killed) is replaced by a fresh
  actor in the same loop that runs every call, within ``max_restarts`` replacements per call.  A fresh
  engine serves the checkpoint it was started from, so once the trainer has pushed weights it is
  *stale*: :meth:`stale_engines` lists it until a sync that started after its restart completes
  (:meth:`begin_sync` / :meth:`end_sync`), and :meth:`generate` never uses a stale engine.  It raises
  :class:`StaleEnginesError` (with what was generated) when no fresh engine is left, so the trainer
  re-syncs and continues (rlhf/workers/rollout.py); that works identically on CPU and GPU.
* Colocated engines share devices with the trainer: :meth:`release_memory_occupation` frees their
  weights and KV cache while it trains, :meth:`resume_memory_occupation` re-allocates exactly the tags
  that were released (SGLang's scheduler fails on a resume of something not released).
  Disaggregated engines keep their memory (both calls are no-ops).
* Released weights are gone: SGLang's memory saver keeps no CPU copy (``enable_weights_cpu_backup`` is off), so
  a resume gives back memory, not the weights.  An engine whose weights were resumed serves garbage until a
  sync reaches it; :meth:`generate` raises :class:`WeightsDiscardedError` instead (the same on CPU, where
  nothing is freed, so the CPU suite catches a missing sync).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from rlhf import faults
from rlhf.rollout.engine import Pending
from rlhf.rollout.engine_args import engine_env, engine_kwargs, expected_weights_from_checkpoint
from rlhf.rollout.placement import PlacementPlan, engine_actor_options, plan_placement
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.sglang_engine import MEMORY_TAGS, SGLangEngine
from rlhf.rollout.types import RolloutSample

__all__ = ["RolloutManager", "RolloutFailedError", "StaleEnginesError", "WeightsDiscardedError", "split_evenly",
           "assert_plain_data"]

logger = logging.getLogger(__name__)


class RolloutFailedError(RuntimeError):
    """An engine kept dying: ``max_restarts`` replacements within one call were not enough."""


class StaleEnginesError(RuntimeError):
    """Generation cannot go on until the trainer pushes the latest weights into ``engines``.

    Attributes: engines (stale engine indices), samples (generated so far, prompt_index relative to the
    call), unfinished (prompt indices still to generate).
    """

    def __init__(self, engines: List[int], samples: List[RolloutSample], unfinished: List[int]):
        super().__init__(f"rollout engines {engines} were restarted and need the latest weights "
                         f"({len(unfinished)} prompts left)")
        self.engines, self.samples, self.unfinished = engines, samples, unfinished


class WeightsDiscardedError(RuntimeError):
    """Generation was asked of engines whose weights were released and resumed without a sync since: SGLang's
    memory saver discarded them (no CPU backup), so they would generate garbage.  Attribute: engines."""

    def __init__(self, engines: List[int]):
        super().__init__(f"rollout engines {engines} resumed their weights after a release without a weight sync "
                         f"since (SGLang's memory saver keeps no copy of released weights: they would generate "
                         f"garbage); push the actor's weights (RolloutWorker.sync_weights) before generate(), or "
                         f"do not release weights that will not be synced")
        self.engines = engines


def split_evenly(items: Sequence[int], n_parts: int) -> List[List[int]]:
    """Contiguous, balanced, non-empty parts of ``items`` (at most ``n_parts``)."""
    base, extra = divmod(len(items), n_parts)
    out, s = [], 0
    for k in range(n_parts):
        e = s + base + (1 if k < extra else 0)
        if e > s:
            out.append(list(items[s:e]))
        s = e
    return out


def assert_plain_data(method: str, *values) -> None:
    """Weight updates carry bytes and metadata only: a tensor here would be pickled through Ray's object
    store (a CUDA view drags its whole storage along) and re-shared by the actor, which CUDA refuses."""
    import torch

    def walk(v):
        if isinstance(v, torch.Tensor):
            raise TypeError(f"{method}: a torch.Tensor was passed to a rollout engine; send serialized "
                            f"FlattenedTensorBucket payloads (bytes) instead")
        if isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for v in values:
        walk(v)


def _is_actor_death(err: BaseException) -> bool:
    """True for the errors of a call whose engine actor is gone: it died (RayActorError), cannot be reached
    (ActorUnavailableError), or Ray's memory monitor killed its worker (OutOfMemoryError: the actor, with
    max_restarts=0, is dead too)."""
    import ray

    return isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                            ray.exceptions.OutOfMemoryError))


def kill_and_wait(actor, timeout_s: float = 60.0) -> None:
    """``ray.kill`` ``actor`` and wait until Ray answers for it as dead: ``ray.kill`` only asks the GCS, so a call
    sent at once could still run on the old actor.  Raises RuntimeError if it still answers after ``timeout_s``."""
    import ray

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"actor {actor} still answers {timeout_s:g} s after ray.kill")


class RolloutManager:
    """Start and drive ``num_engines`` engines (an :class:`rlhf.rollout.engine.EngineFleet`).

    Args:
        num_engines: engines (each with ``engine_config["tp_size"]`` ranks).
        engine_config: :func:`rlhf.rollout.engine_args.engine_kwargs` arguments (``model_path`` required;
            ``engine_overrides`` = extra ``sglang.Engine`` kwargs).
        placement: "colocated" or "disaggregated".
        max_restarts: engine replacements allowed within ONE call before :class:`RolloutFailedError`.
        plan: the GPUs of every engine (:func:`rlhf.rollout.placement.plan_placement`); None on a GPU host:
            engine i on this node's GPUs ``i * tp ...``; ignored on CPU.
        node_ids: Ray node id of each plan node (None: Ray picks the node).
        actor_options: more Ray actor options (tests).
        start: start the engines now (in parallel) and wait for them; False: :meth:`launch` / :meth:`start`
            later (the first call that needs the engines waits for them).
    Raises:
        ValueError: bad argument values. RuntimeError: Ray is not initialised.
    """

    PLACEMENTS = ("colocated", "disaggregated")

    def __init__(self, num_engines: int, engine_config: Dict[str, Any], placement: str = "colocated",
                 max_restarts: int = 2, plan: Optional[PlacementPlan] = None, node_ids: Optional[List[str]] = None,
                 actor_options: Optional[Dict[str, Any]] = None, start: bool = True):
        import ray

        if not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be an int >= 1, got {num_engines!r}")
        if placement not in self.PLACEMENTS:
            raise ValueError(f"placement must be one of {self.PLACEMENTS}, got {placement!r}")
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if not ray.is_initialized():
            raise RuntimeError("RolloutManager needs ray.init() first")
        cfg = dict(engine_config)
        self.kwargs = engine_kwargs(**cfg.pop("engine_overrides", None) or {}, **cfg)
        self.num_engines, self.tp_size = num_engines, int(self.kwargs["tp_size"])
        self.placement, self.max_restarts = placement, max_restarts
        if self.kwargs.get("device") != "cpu" and plan is None:
            plan = plan_placement(nnodes=1, gpus_per_node=max(num_engines * self.tp_size, 1),
                                  trainer_world_size=num_engines * self.tp_size, num_engines=num_engines,
                                  engine_tp=self.tp_size, mode="colocated")
        self.plan = plan if self.kwargs.get("device") != "cpu" else None
        self._expected = expected_weights_from_checkpoint(self.kwargs["model_path"], self.kwargs["dtype"])
        self._options = dict(node_ids=node_ids, actor_options=dict(actor_options or {}))
        self.restarts = [0] * num_engines  # replacements per engine, ever
        self.restart_log: List[Dict[str, Any]] = []
        self._stale: set = set()
        self._weights_pushed = False
        self._generating = 0  # generate() calls in progress (begin_sync refuses a sync meanwhile)
        self._left_running: List[Any] = []  # engines' generate calls a generate() that raised left running
        self._released: set = set()  # tags the engines should have released (colocated)
        self._engine_released: List[set] = [set() for _ in range(num_engines)]  # what each engine has released
        self._discarded: set = set()  # engines whose weights were resumed after a release, not synced since
        self.actors: List[Any] = []
        self.startup_info: List[Dict[str, Any]] = []
        if start:
            self.start()

    # ------------------------------------------------------------------ actors
    def _make_actor(self, index: int):
        import ray

        opts = engine_actor_options(index, env=engine_env(self.kwargs, colocated=self.placement == "colocated"),
                                    plan=self.plan, **self._options)
        kw = dict(self.kwargs)
        if self.plan is not None:
            kw.setdefault("base_gpu_id", self.plan.base_gpu_id(index))  # the actor sees all GPUs of its node
        return ray.remote(SGLangEngine).options(**opts).remote(kw, index, self._expected)

    def launch(self) -> None:
        """Create every engine's actor: the engines start in parallel, in the background (the caller goes on
        building its models); :meth:`start` waits for them, and so does the first call that needs them."""
        if not self.actors:
            self.actors = [self._make_actor(i) for i in range(self.num_engines)]

    def start(self) -> List[Dict[str, Any]]:
        """:meth:`launch` (when not done) and wait until every engine is up; returns their
        :meth:`SGLangEngine.info`.  Raises what an engine raised while starting (the actor is then dead)."""
        import ray

        self.launch()
        if not self.startup_info:
            t0 = time.time()
            self.startup_info = ray.get([a.info.remote() for a in self.actors])
            logger.info("[rollout] %d engine(s) up (engine start %s s; waited %.1f s for them)", self.num_engines,
                        "/".join(f"{i['startup_seconds']:.1f}" for i in self.startup_info), time.time() - t0)
        return self.startup_info

    @property
    def num_restarts(self) -> int:
        return sum(self.restarts)

    def _replace(self, index: int, reason: str) -> None:
        """Kill what is left of engine ``index`` and start a fresh one (stale once weights were pushed)."""
        import ray

        t0 = time.time()
        logger.warning("rollout engine %d died (%s); starting a new one", index, reason)
        try:
            ray.kill(self.actors[index], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.actors[index] = self._make_actor(index)
        ray.get(self.actors[index].info.remote())
        self.restarts[index] += 1
        if self._weights_pushed:
            self._stale.add(index)
        self._engine_released[index] = set()  # a new engine holds all its memory
        self._discarded.discard(index)  # ... and its checkpoint's weights (stale once weights were pushed)
        self.restart_log.append({"engine": index, "reason": reason, "seconds": time.time() - t0})

    def _budget(self, what: str) -> Callable[[int, BaseException], None]:
        used = [0]

        def on_death(index: int, err: BaseException) -> None:
            used[0] += 1
            if used[0] > self.max_restarts:
                raise RolloutFailedError(f"{what}: engine {index} died and the restart budget "
                                         f"(max_restarts={self.max_restarts}) is spent: {err}") from err
            self._replace(index, f"{what}: {type(err).__name__}")
        return on_death

    # ------------------------------------------------------------------ fan-out (rlhf.rollout.engine)
    def _start(self, method: Callable[[Any], Any], what: str, *args, engines: Optional[Sequence[int]] = None,
               per_engine: Optional[Sequence[Dict[str, Any]]] = None, **kwargs) -> Pending:
        """Start ``method(actor)(*args, **kwargs, **per_engine[k])`` on engines ``engines`` (default all);
        ``method`` picks the actor's method (``lambda a: a.flush_cache``)."""
        self.start()  # engines launched in the background are up before anything is asked of them
        targets = list(range(self.num_engines)) if engines is None else list(engines)
        if what.startswith("update_weights"):
            assert_plain_data(what, args, kwargs, per_engine)
        extra = list(per_engine) if per_engine is not None else [{}] * len(targets)
        if len(extra) != len(targets):
            raise ValueError(f"{what}: {len(extra)} per-engine arguments for {len(targets)} engines {targets}")
        # each call carries the engine's restart count: wait() replaces only the actor the call went to
        return [(i, (method(self.actors[i]).remote(*args, **kwargs, **kw), self.restarts[i]))
                for i, kw in zip(targets, extra)]

    def _run(self, method: Callable[[Any], Any], what: str, *args, **kwargs) -> List[Any]:
        """:meth:`_start` then :meth:`wait`."""
        return self.wait(self._start(method, what, *args, **kwargs), what)

    def wait(self, pending: Pending, what: str = "call") -> List[Any]:
        """Results of a started call in order; a dead engine is replaced (and is stale) and gives None.  Every call
        is waited for before the first error is raised (an engine still loading from a buffer the caller would
        reuse), and an engine already replaced since the call was made is not replaced again."""
        import ray

        on_death, out, error = self._budget(what), [], None
        for i, (ref, restarts) in pending:
            try:
                out.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - classified
                out.append(None)
                if not _is_actor_death(e):
                    error = error or e
                elif restarts == self.restarts[i]:
                    try:
                        on_death(i, e)
                    except Exception as budget:  # noqa: BLE001 - the restart budget is spent
                        error = error or budget
        if error is not None:
            raise error
        return out

    def info(self, engines: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
        """Each engine's :meth:`SGLangEngine.info`."""
        return self._run(lambda a: a.info, "info", engines=engines)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        """``sampling.n`` samples per prompt over the fresh engines, prompt-major, ``prompt_index``
        relative to the whole call.  Prompts of an engine that dies go to the other fresh engines.

        Raises:
            RuntimeError: colocated engines are released (resume them first).
            WeightsDiscardedError: engines resumed their weights and no sync reached them since.
            StaleEnginesError: no fresh engine left (the trainer must sync weights, then generate the rest).
            RolloutFailedError: the restart budget is spent.
        """
        if self._released:
            raise RuntimeError(f"rollout engines have released {sorted(self._released)}: call "
                               f"resume_memory_occupation() before generate()")
        if self._discarded:
            raise WeightsDiscardedError(sorted(self._discarded))
        self.start()
        if faults.fires("rollout_engine_death"):  # fault injection (rlhf.faults): the engine dies under this call
            logger.warning("FAULT rollout_engine_death: killing rollout engine 0")
            kill_and_wait(self.actors[0])
        prompts = [list(p) for p in prompt_token_ids]
        todo, done, on_death = list(range(len(prompts))), {}, self._budget("generate")
        pending: Dict[Any, Any] = {}
        self._generating += 1
        try:
            return self._generate_all(prompts, sampling, todo, done, on_death, pending)
        finally:
            self._generating -= 1
            self._left_running += list(pending)  # non-empty only when an error left engine calls running

    def _generate_all(self, prompts, sampling, todo, done, on_death, pending) -> List[RolloutSample]:
        """:meth:`generate`'s rounds; ``pending`` (``{ref: (engine, prompt indices)}``) holds the engine calls in
        flight, which generate() keeps when an error leaves some running."""
        import ray

        while todo:
            fresh = [i for i in range(self.num_engines) if i not in self._stale]
            if not fresh:
                samples = [s for k in sorted(done) for s in done[k]]
                raise StaleEnginesError(sorted(self._stale), samples, todo)
            for engine, part in zip(fresh, split_evenly(todo, len(fresh))):
                pending[self.actors[engine].generate.remote([prompts[k] for k in part], sampling)] = (engine, part)
            todo = []
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                engine, part = pending.pop(ref)
                try:
                    samples = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - classified
                    if not _is_actor_death(e):
                        raise
                    on_death(engine, e)
                    todo += part
                    continue
                for s in samples:
                    s.prompt_index = part[s.prompt_index]
                    done.setdefault(s.prompt_index, []).append(s)
            todo.sort()
        return [s for k in sorted(done) for s in sorted(done[k], key=lambda x: x.sample_index)]

    # ------------------------------------------------------------------ weights (the trainer's weight sync)
    def expected_weights(self) -> Dict[str, Any]:
        """``{hf_name: (shape, dtype)}`` every engine accepts (all serve the same model)."""
        return dict(self._expected)

    def fingerprint(self) -> tuple:
        """Changes whenever what a weight sync was planned and validated against changes."""
        return (self.kwargs["model_path"], self.kwargs["dtype"], self.tp_size, self.num_engines, tuple(self.restarts))

    def stale_engines(self) -> List[int]:
        """Engines restarted since the last sync that reached them (they serve old weights)."""
        return sorted(self._stale)

    def weights_discarded(self) -> List[int]:
        """Engines whose weights were released and resumed with no sync since (they hold garbage)."""
        return sorted(self._discarded)

    def begin_sync(self) -> tuple:
        """Called by the weight sync before it sends; returns a token for :meth:`end_sync`.

        Raises:
            RuntimeError: a :meth:`generate` is in progress (another thread), or one that raised left requests
                running on an engine: a sync writes into the engines' parameters, which those forward passes would
                read half-written.  Sync between rollouts.
        """
        if self._left_running:
            import ray

            _, self._left_running = ray.wait(self._left_running, num_returns=len(self._left_running), timeout=0,
                                             fetch_local=False)
        if self._generating or self._left_running:
            raise RuntimeError(f"weight sync refused: {self._generating} generate() call(s) in progress and "
                               f"{len(self._left_running)} engine generate call(s) still running; the sync writes "
                               f"into the engines' parameters, so it must run between rollouts")
        self._weights_pushed = True
        return tuple(self.restarts)

    def replaced_since(self, token: tuple) -> List[int]:
        """Engines replaced after :meth:`begin_sync` returned ``token``."""
        return [i for i in range(self.num_engines) if self.restarts[i] != token[i]]

    def end_sync(self, token: tuple, engines: Optional[Sequence[int]] = None) -> None:
        """A sync begun with ``token`` reached ``engines`` (default all): those not restarted since are fresh and
        hold the pushed weights."""
        for i in (range(self.num_engines) if engines is None else engines):
            if self.restarts[i] == token[i]:
                self._stale.discard(i)
                self._discarded.discard(i)

    # ------------------------------------------------------------------ weights: SGLang's calls
    def begin_weight_update(self, engines: Optional[Sequence[int]] = None) -> None:
        self._run(lambda a: a.begin_weight_update, "begin_weight_update", engines=engines)

    def start_weight_update(self, engines: Optional[Sequence[int]] = None) -> Pending:
        return self._start(lambda a: a.begin_weight_update, "begin_weight_update", engines=engines)

    def end_weight_update(self, engines: Optional[Sequence[int]] = None) -> List[Any]:
        return self._run(lambda a: a.end_weight_update, "end_weight_update", engines=engines)

    def update_weights_from_tensor(self, payloads: Sequence[Sequence[bytes]], engines: Optional[Sequence[int]] = None,
                                   load_format: str = "flattened_bucket", flush_cache: bool = False) -> Pending:
        return self._start(lambda a: a.update_weights_from_tensor, "update_weights_from_tensor", engines=engines,
                           per_engine=[{"serialized_named_tensors": list(p)} for p in payloads],
                           load_format=load_format, flush_cache=flush_cache)

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                                  backend: str, rank_offsets: Sequence[int]) -> Pending:
        return self._start(lambda a: a.init_weights_update_group, "init_weights_update_group", master_address,
                           master_port, world_size=world_size, group_name=group_name, backend=backend,
                           per_engine=[{"rank_offset": int(r)} for r in rank_offsets])

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str, flush_cache: bool = False,
                                        load_format: Optional[str] = "flattened_bucket") -> Pending:
        return self._start(lambda a: a.update_weights_from_distributed, "update_weights_from_distributed",
                           list(names), list(dtypes), [list(x) for x in shapes], group_name,
                           flush_cache=flush_cache, load_format=load_format)

    def load_lora_adapter(self, tensors: Dict[str, Any], config: Dict[str, Any],
                          engines: Optional[Sequence[int]] = None) -> Pending:
        return self._start(lambda a: a.load_lora_adapter, "load_lora_adapter", tensors, config, engines=engines)

    def engine_parameters(self, engines: Optional[Sequence[int]] = None) -> List[Any]:
        return self._run(lambda a: a.engine_parameters, "engine_parameters", engines=engines)

    def destroy_weights_update_group(self, group_name: str) -> List[Any]:
        return self._run(lambda a: a.destroy_weights_update_group, "destroy_weights_update_group", group_name)

    def update_weights_from_disk(self, model_path: str, engines: Optional[Sequence[int]] = None) -> List[Any]:
        return self._run(lambda a: a.update_weights_from_disk, "update_weights_from_disk", model_path,
                         engines=engines)

    def get_weights_by_name(self, name: str, truncate_size: int = 100,
                            engines: Optional[Sequence[int]] = None) -> List[Any]:
        return self._run(lambda a: a.get_weights_by_name, "get_weights_by_name", name, truncate_size=truncate_size,
                         engines=engines)

    def flush_cache(self, engines: Optional[Sequence[int]] = None) -> None:
        self._run(lambda a: a.flush_cache, "flush_cache", engines=engines)

    # ------------------------------------------------------------------ memory (colocated)
    def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated: free every engine's ``tags`` (default weights and KV cache; no-op when disaggregated or
        released)."""
        if self.placement == "colocated":
            self._released = set(tags or MEMORY_TAGS)
            self._converge()

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated: re-allocate ``tags`` (default all) on the engines that released them; never resumes
        what an engine holds (SGLang's scheduler fails on that).  Resumed weights are memory only: those engines
        are :meth:`weights_discarded` until a sync reaches them."""
        if self.placement == "colocated":
            self._released -= set(tags or MEMORY_TAGS)
            self._converge()

    def _converge(self) -> None:
        """Bring every engine to the wanted released tags (an engine replaced meanwhile starts resident)."""
        for _ in range(self.max_restarts + 2):
            for method, actor_method, todo in (
                    ("release_memory_occupation", lambda a: a.release_memory_occupation,
                     lambda i: self._released - self._engine_released[i]),
                    ("resume_memory_occupation", lambda a: a.resume_memory_occupation,
                     lambda i: self._engine_released[i] - self._released)):
                engines = [i for i in range(self.num_engines) if todo(i)]
                if not engines:
                    continue
                tags = [sorted(todo(i)) for i in engines]
                before = list(self.restarts)
                self._run(actor_method, method, engines=engines, per_engine=[{"tags": t} for t in tags])
                for i, t in zip(engines, tags):
                    if self.restarts[i] == before[i]:
                        self._engine_released[i] = (self._engine_released[i] | set(t) if method.startswith("release")
                                                    else self._engine_released[i] - set(t))
                        if method.startswith("resume") and "weights" in t:
                            self._discarded.add(i)
            if all(self._engine_released[i] == self._released for i in range(self.num_engines)):
                return
        raise RolloutFailedError(f"rollout engines could not reach released tags {sorted(self._released)}")

    @property
    def released_tags(self) -> List[str]:
        return sorted(self._released)

    # ------------------------------------------------------------------ lifetime
    def engine_pids(self) -> List[int]:
        """Process ids of the engine actors (the SGLang schedulers are their children)."""
        return [info["pid"] for info in self.info()]

    def shutdown(self) -> None:
        """Stop every engine and kill its actor (idempotent)."""
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort
                pass
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
