"""Ray options of each engine actor: resources, placement, process environment.

* CPU (no GPU in the Ray cluster): light actors (``num_cpus=0``); SGLang's scheduler processes do the work.
* Disaggregated on GPU: a placement group of the engines' own, one bundle ``{"GPU": tp_size, "CPU": 1}``
  per engine, so engines never land on the trainer's GPUs.
* Colocated on GPU: a fraction of the trainer's GPUs (``colocate_gpu_fraction``), optionally in the
  trainer's placement group (bundle ``index * tp_size``); engine TP > 1 sees all GPUs of its node and
  picks ``base_gpu_id = index * tp_size``.
Actors are never restarted by Ray (``max_restarts=0``): the manager replaces a dead engine itself.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

__all__ = ["engine_actor_options"]


def engine_actor_options(index: int, *, num_engines: int, tp_size: int, placement: str, use_gpu: bool,
                         env: Dict[str, str], placement_group=None, colocate_gpu_fraction: float = 0.2,
                         actor_options: Optional[Dict[str, Any]] = None, own_pg=None) -> Tuple[Dict[str, Any], Any]:
    """``(options for ray.remote(...).options(), the engines' own placement group or None)``.

    ``own_pg`` is the placement group made for an earlier engine of the same manager (reused).
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    env = dict(env)
    opts: Dict[str, Any] = {"max_restarts": 0, "max_concurrency": 1, "runtime_env": {"env_vars": env}}
    if not use_gpu:
        opts.update(num_cpus=0, num_gpus=0)
    elif placement == "disaggregated":
        import ray

        if own_pg is None:
            own_pg = ray.util.placement_group([{"GPU": tp_size, "CPU": 1}] * num_engines, strategy="PACK")
            ray.get(own_pg.ready())
        opts.update(num_cpus=1, num_gpus=tp_size, scheduling_strategy=PlacementGroupSchedulingStrategy(
            own_pg, placement_group_bundle_index=index))
    else:
        opts.update(num_cpus=0, num_gpus=colocate_gpu_fraction)
        if tp_size > 1:
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        if placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=index * tp_size)
    opts.update(actor_options or {})
    return opts, own_pg
