"""Several rollout engines as Ray actors: batch splitting, crash supervision and restart, placement.

Each :class:`RolloutEngineActor` owns one :class:`~rlhf.rollout.engine.RolloutEngine`, i.e. one SGLang
engine in its own child process, so an SGLang crash kills neither the actor nor the caller (trainer).
:class:`RolloutManager` drives ``num_engines`` actors:

* ``generate`` splits the prompts into contiguous chunks, one per engine; when an engine process dies
  mid-rollout the manager restarts it (a fresh child), restores the latest weights (see below) and
  retries that engine's chunk, so the step completes. ``num_restarts`` counts restarts.
* Latest weights after a restart, in order of preference: a ``weight_restore_fn(manager, engine_index)``
  callback (e.g. the trainer re-broadcasts); else the tensors of the last ``update_weights_from_tensor``
  when ``retain_latest_weights=True``; else the directory of the last ``update_weights_from_disk``; else the
  initial checkpoint (only correct before the first update: a warning is logged otherwise).
* Placement: ``"colocated"`` engines share devices with the trainer and must release their memory while it
  trains (:meth:`RolloutManager.release_memory_occupation` / :meth:`resume_memory_occupation`);
  ``"disaggregated"`` engines stay resident (those two calls are no-ops). On a GPU cluster disaggregated
  engines get a placement group of their own, one bundle ``{"GPU": tp_size, "CPU": 1}`` per engine;
  colocated engines take a fraction of the trainer's GPUs (``colocate_gpu_fraction``), optionally in the
  trainer's placement group. On CPU both run locally as actors with ``num_cpus=0``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from rlhf.rollout.engine import EngineCallError, EngineDiedError, RolloutEngine
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import RolloutSample

__all__ = ["RolloutEngineActor", "RolloutManager", "RolloutFailedError"]

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RolloutFailedError(RuntimeError):
    """A rollout could not be completed within ``max_restarts`` engine restarts."""


class RolloutEngineActor:
    """Body of a Ray actor that owns one :class:`RolloutEngine` (its SGLang engine lives in a child process).

    Created by :class:`RolloutManager` as ``ray.remote(RolloutEngineActor).options(...).remote(kwargs, i)``.
    Every engine method is forwarded; :class:`EngineDiedError` propagates (wrapped by Ray) when the engine
    process died -- the actor itself stays usable and :meth:`restart` brings up a fresh engine.

    Args:
        engine_kwargs: keyword arguments of :class:`RolloutEngine` (``start`` is forced to False).
        engine_index: position of this engine in its manager (for logs).
    """

    def __init__(self, engine_kwargs: Dict[str, Any], engine_index: int = 0):
        kw = dict(engine_kwargs)
        kw["start"] = False
        self.engine_index = engine_index
        self.engine = RolloutEngine(**kw)

    def start(self) -> Dict[str, Any]:
        """Start the engine child; returns ``{"pid", "startup_seconds"}``."""
        self.engine.start()
        return {"pid": self.engine.pid, "startup_seconds": self.engine.startup_seconds}

    def restart(self) -> Dict[str, Any]:
        """Reap the (dead or alive) engine child and start a fresh one from ``model_path``."""
        self.engine.restart()
        return {"pid": self.engine.pid, "startup_seconds": self.engine.startup_seconds}

    def pid(self) -> Optional[int]:
        """Process id of the engine child (to inspect or, in tests, kill it)."""
        return self.engine.pid

    def is_alive(self) -> bool:
        return self.engine.is_alive()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def expected_weights(self):
        return self.engine.expected_weights()

    def generate(self, prompt_token_ids, sampling: SamplingConfig) -> List[RolloutSample]:
        return self.engine.generate(prompt_token_ids, sampling)

    def update_weights_from_tensor(self, named_tensors, validate: bool = True) -> None:
        self.engine.update_weights_from_tensor(named_tensors, validate=validate)

    def update_weights_from_disk(self, path: str) -> None:
        self.engine.update_weights_from_disk(path)

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def end_weight_update(self) -> None:
        self.engine.end_weight_update()

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl") -> None:
        self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                              backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, validate=True) -> None:
        self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name, validate=validate)

    def destroy_weights_update_group(self, group_name) -> None:
        self.engine.destroy_weights_update_group(group_name)

    def get_weights_by_name(self, name, truncate_size=1 << 30):
        return self.engine.get_weights_by_name(name, truncate_size)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def release_memory_occupation(self) -> None:
        self.engine.release_memory_occupation()

    def resume_memory_occupation(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _is_engine_death(err: BaseException) -> bool:
    """True for an engine child death (EngineDiedError, possibly wrapped by Ray) or a dead actor."""
    import ray

    if isinstance(err, EngineDiedError):
        return True
    if isinstance(err, ray.exceptions.RayActorError):
        return True
    cause = getattr(err, "cause", None)
    return isinstance(cause, EngineDiedError)


def _split(n_items: int, n_parts: int) -> List[Tuple[int, int]]:
    """Contiguous balanced [start, end) ranges; empty ranges are dropped."""
    base, extra = divmod(n_items, n_parts)
    out, s = [], 0
    for k in range(n_parts):
        e = s + base + (1 if k < extra else 0)
        if e > s:
            out.append((s, e))
        s = e
    return out


class RolloutManager:
    """``num_engines`` SGLang engines behind Ray actors, with restart-on-crash.

    Args:
        num_engines: number of engines (each with ``engine_kwargs["tp_size"]`` ranks).
        engine_kwargs: :class:`RolloutEngine` keyword arguments (``model_path`` required).
        placement: "colocated" or "disaggregated" (see module docstring).
        max_restarts: engine restarts allowed within ONE manager call before :class:`RolloutFailedError`.
        retain_latest_weights: keep (a Ray object reference to) the last full ``update_weights_from_tensor``
            payload to re-push after a restart.
        weight_restore_fn: ``fn(manager, engine_index)`` called after an engine restart to give it the latest
            weights (takes precedence over the retained tensors / last disk path).
        use_gpu: place engines on GPUs (default: the Ray cluster has GPUs).
        placement_group: colocated on GPU: the trainer's placement group (bundle ``i * tp_size`` hosts engine i).
        colocate_gpu_fraction: colocated on GPU: ``num_gpus`` of each engine actor.
        actor_options: extra ``.options(...)`` for the actors.
        start: start the engines now (in parallel).

    Raises:
        ValueError: bad argument values. RuntimeError: Ray is not initialised.
    """

    PLACEMENTS = ("colocated", "disaggregated")

    def __init__(self, num_engines: int, engine_kwargs: Dict[str, Any], placement: str = "colocated",
                 max_restarts: int = 2, retain_latest_weights: bool = False,
                 weight_restore_fn: Optional[Callable[["RolloutManager", int], None]] = None,
                 use_gpu: Optional[bool] = None, placement_group=None, colocate_gpu_fraction: float = 0.2,
                 actor_options: Optional[Dict[str, Any]] = None, start: bool = True):
        import ray

        if not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be an int >= 1, got {num_engines!r}")
        if placement not in self.PLACEMENTS:
            raise ValueError(f"placement must be one of {self.PLACEMENTS}, got {placement!r}")
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if "model_path" not in engine_kwargs:
            raise ValueError("engine_kwargs must contain 'model_path'")
        if not ray.is_initialized():
            raise RuntimeError("RolloutManager needs ray.init() first")
        self.num_engines = num_engines
        self.engine_kwargs = dict(engine_kwargs)
        self.tp_size = int(self.engine_kwargs.get("tp_size", 1))
        self.placement = placement
        self.max_restarts = max_restarts
        self.retain_latest_weights = retain_latest_weights
        self.weight_restore_fn = weight_restore_fn
        self.use_gpu = (ray.cluster_resources().get("GPU", 0) > 0) if use_gpu is None else bool(use_gpu)
        self._external_pg = placement_group
        self.colocate_gpu_fraction = colocate_gpu_fraction
        self.actor_options = dict(actor_options or {})
        self.num_restarts = 0
        self.restart_log: List[Dict[str, Any]] = []
        self._latest_tensors_ref = None
        self._latest_path: Optional[str] = None
        self._updated_since_start = False
        self._released = False
        self._own_pg = None
        self.actors: List[Any] = [self._make_actor(i) for i in range(num_engines)]
        self.startup_info: List[Dict[str, Any]] = []
        if start:
            self.start()

    # ------------------------------------------------------------------ actors and placement
    def _actor_options(self, index: int) -> Dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # the engine child is started with the repo on PYTHONPATH; the actor itself must import rlhf too
        env = {"PYTHONPATH": os.pathsep.join(p for p in [_REPO_ROOT, os.environ.get("PYTHONPATH", "")] if p)}
        opts: Dict[str, Any] = {"max_concurrency": 4, "runtime_env": {"env_vars": env}}
        if not self.use_gpu:
            # CPU: lightweight actors; the engine child processes do the work
            opts.update(num_cpus=0, num_gpus=0)
        elif self.placement == "disaggregated":
            import ray

            if self._own_pg is None:
                self._own_pg = ray.util.placement_group(
                    [{"GPU": self.tp_size, "CPU": 1}] * self.num_engines, strategy="PACK")
                ray.get(self._own_pg.ready())
            opts.update(num_cpus=1, num_gpus=self.tp_size, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._own_pg, placement_group_bundle_index=index))
        else:  # colocated on GPU: share the trainer's devices
            opts.update(num_cpus=0, num_gpus=self.colocate_gpu_fraction)
            if self.tp_size > 1:
                # the actor must see all GPUs of its node; SGLang picks base_gpu_id.. base_gpu_id+tp-1
                env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            if self._external_pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self._external_pg, placement_group_bundle_index=index * self.tp_size)
        opts.update(self.actor_options)
        return opts

    def _make_actor(self, index: int):
        import ray

        kw = dict(self.engine_kwargs)
        if self.use_gpu and self.placement == "colocated" and self.tp_size > 1:
            overrides = dict(kw.get("engine_overrides") or {})
            overrides.setdefault("base_gpu_id", index * self.tp_size)
            kw["engine_overrides"] = overrides
        return ray.remote(RolloutEngineActor).options(**self._actor_options(index)).remote(kw, index)

    def start(self) -> List[Dict[str, Any]]:
        """Start all engines in parallel; returns per-engine ``{"pid", "startup_seconds"}``."""
        import ray

        self.startup_info = ray.get([a.start.remote() for a in self.actors])
        return self.startup_info

    def engine_pids(self) -> List[Optional[int]]:
        """Process ids of the engine children (answered even while the engines generate)."""
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def _restart_engine(self, index: int, reason: str) -> None:
        import ray

        self.num_restarts += 1
        t0 = time.time()
        logger.warning("rollout engine %d died (%s); restarting (restart #%d)", index, reason, self.num_restarts)
        try:
            ray.get(self.actors[index].restart.remote())
        except ray.exceptions.RayActorError:
            # the actor process itself is gone: replace it
            self.actors[index] = self._make_actor(index)
            ray.get(self.actors[index].start.remote())
        self._restore_weights(index)
        if self._released:
            ray.get(self.actors[index].release_memory_occupation.remote())
        self.restart_log.append({"engine": index, "reason": reason, "seconds": time.time() - t0})

    def _restore_weights(self, index: int) -> None:
        import ray

        actor = self.actors[index]
        if self.weight_restore_fn is not None:
            self.weight_restore_fn(self, index)
        elif self._latest_tensors_ref is not None:
            ray.get(actor.update_weights_from_tensor.remote(self._latest_tensors_ref))
        elif self._latest_path is not None:
            ray.get(actor.update_weights_from_disk.remote(self._latest_path))
        elif self._updated_since_start:
            logger.warning("restarted engine %d runs the initial checkpoint: the latest weights were not retained "
                           "(set retain_latest_weights=True, weight_restore_fn, or update from disk)", index)

    def _run_all(self, what: str, call: Callable[[Any], Any]) -> List[Any]:
        """Run ``call(actor)`` on every engine; restart and retry engines that died (bounded)."""
        import ray

        results: List[Any] = [None] * self.num_engines
        todo = list(range(self.num_engines))
        restarts = 0
        while todo:
            refs = {i: call(self.actors[i]) for i in todo}
            failed = []
            for i, ref in refs.items():
                try:
                    results[i] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - classified below
                    if not _is_engine_death(e):
                        raise
                    failed.append((i, e))
            todo = []
            for i, e in failed:
                restarts += 1
                if restarts > self.max_restarts:
                    raise RolloutFailedError(f"{what}: engine {i} died and the restart budget "
                                             f"(max_restarts={self.max_restarts}) is spent: {e}") from e
                self._restart_engine(i, f"{what}: {type(e).__name__}")
                todo.append(i)
        return results

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        """Generate ``sampling.n`` samples per prompt across all engines.

        Prompts are split into contiguous balanced chunks (one per engine). A chunk whose engine dies is
        retried on the restarted engine (with the latest weights), up to ``max_restarts`` restarts per call.

        Returns:
            ``len(prompts) * n`` samples, prompt-major, ``prompt_index`` relative to the whole batch.
        Raises:
            RolloutFailedError: restarts exhausted. RuntimeError: colocated engines are released.
            EngineCallError: SGLang rejected a request.
        """
        import ray

        if self._released:
            raise RuntimeError("rollout engines are released (colocated mode): call resume_memory_occupation() "
                               "before generate()")
        prompts = [list(p) for p in prompt_token_ids]
        if not prompts:
            return []
        chunks = _split(len(prompts), self.num_engines)
        out: Dict[int, List[RolloutSample]] = {}
        pending = {k: self.actors[k].generate.remote(prompts[s:e], sampling) for k, (s, e) in enumerate(chunks)}
        restarts = 0
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1)
            k = next(k for k, r in pending.items() if r == ready[0])
            del pending[k]
            s, e = chunks[k]
            try:
                samples = ray.get(ready[0])
            except Exception as err:  # noqa: BLE001 - classified below
                if not _is_engine_death(err):
                    raise
                restarts += 1
                if restarts > self.max_restarts:
                    raise RolloutFailedError(f"generate: engine {k} died and the restart budget "
                                             f"(max_restarts={self.max_restarts}) is spent: {err}") from err
                self._restart_engine(k, f"generate: {type(err).__name__}")
                pending[k] = self.actors[k].generate.remote(prompts[s:e], sampling)
                continue
            for smp in samples:
                smp.prompt_index += s
            out[k] = samples
        return [smp for k in sorted(out) for smp in out[k]]

    # ------------------------------------------------------------------ weights
    def update_weights_from_tensor(self, named_tensors: Sequence[Tuple[str, Any]], validate: bool = True) -> None:
        """Push full HF-named tensors to every engine (one Ray object shared by all). Dead engines are restarted."""
        import ray

        ref = ray.put(list(named_tensors))
        self._updated_since_start = True
        if self.retain_latest_weights:
            self._latest_tensors_ref = ref
            self._latest_path = None
        self._run_all("update_weights_from_tensor", lambda a: a.update_weights_from_tensor.remote(ref, validate))

    def update_weights_from_disk(self, path: str) -> None:
        """Every engine reloads weights from the HF checkpoint directory ``path`` (remembered for restarts)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"update_weights_from_disk: {path!r} is not a directory")
        self._updated_since_start = True
        self._latest_path = path
        self._latest_tensors_ref = None
        self._run_all("update_weights_from_disk", lambda a: a.update_weights_from_disk.remote(path))

    def begin_weight_update(self) -> None:
        self._run_all("begin_weight_update", lambda a: a.begin_weight_update.remote())

    def end_weight_update(self) -> None:
        self._updated_since_start = True
        self._run_all("end_weight_update", lambda a: a.end_weight_update.remote())

    def weight_update_ranks(self) -> Tuple[int, List[int]]:
        """``(world_size, rank_offsets)`` of a broadcast group with the trainer as rank 0 and every engine's
        TP ranks after it."""
        return 1 + self.num_engines * self.tp_size, [1 + i * self.tp_size for i in range(self.num_engines)]

    def init_weights_update_group_async(self, master_address: str, master_port: int, group_name: str,
                                        backend: str = "nccl") -> List[Any]:
        """Ask every engine to join the group; returns Ray refs to ``ray.get`` after the trainer joined as rank 0
        (world size from :meth:`weight_update_ranks`). Groups are not restored on restart: use
        ``weight_restore_fn``."""
        world, offsets = self.weight_update_ranks()
        return [a.init_weights_update_group.remote(master_address, master_port, off, world, group_name, backend)
                for a, off in zip(self.actors, offsets)]

    def update_weights_from_distributed_async(self, names, dtypes, shapes, group_name: str) -> List[Any]:
        """Every engine starts receiving a broadcast (inside begin/end); returns refs to ``ray.get`` after the
        trainer broadcast all tensors."""
        self._updated_since_start = True
        return [a.update_weights_from_distributed.remote(list(names), list(dtypes), [list(s) for s in shapes],
                                                         group_name) for a in self.actors]

    def destroy_weights_update_group(self, group_name: str) -> None:
        import ray

        ray.get([a.destroy_weights_update_group.remote(group_name) for a in self.actors])

    # ------------------------------------------------------------------ placement-dependent memory handling
    def release_memory_occupation(self) -> None:
        """Colocated: free engine weights + KV cache before training. Disaggregated: no-op."""
        if self.placement != "colocated":
            return
        self._run_all("release_memory_occupation", lambda a: a.release_memory_occupation.remote())
        self._released = True

    def resume_memory_occupation(self) -> None:
        """Colocated: re-allocate engine memory after training (then push new weights). Disaggregated: no-op."""
        if self.placement != "colocated":
            return
        self._run_all("resume_memory_occupation", lambda a: a.resume_memory_occupation.remote())
        self._released = False

    def weight_versions(self) -> List[int]:
        import ray

        return ray.get([a.weight_version.remote() for a in self.actors])

    def shutdown(self) -> None:
        """Shut down every engine child and actor (idempotent)."""
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=120)
            except Exception:  # noqa: BLE001 - best effort
                pass
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        if self._own_pg is not None:
            ray.util.remove_placement_group(self._own_pg)
            self._own_pg = None
