"""The Ray cluster the rollout engines and reward-model workers run in."""
from __future__ import annotations

import os

__all__ = ["init_ray", "LOCAL_SYSTEM_CONFIG"]

#: Ray settings of a cluster this job starts itself.  The job's actors (engines, reward-model workers) take no
#: CPU resource and carry their own runtime env, so none of them runs in a prestarted default worker: without
#: this Ray starts one idle Python worker per CPU (each ~45 MB resident, importing Ray while the job starts).
LOCAL_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def init_ray() -> None:
    """Connect this process to Ray once: the cluster at ``RAY_ADDRESS`` when set, else a new local one (no
    dashboard, worker logs not echoed, :data:`LOCAL_SYSTEM_CONFIG`)."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
                 _system_config=dict(LOCAL_SYSTEM_CONFIG))
