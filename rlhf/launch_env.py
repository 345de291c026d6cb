"""Which process of a job this is, from the launcher's environment (no torch import).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; Slurm's srun sets SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID.  torchrun wins when both are set (torchrun inside an srun allocation); with neither it is
a single process of unknown world size.  Same rules as ``parallel.distributed.detect_launch_env``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["LaunchEnv", "launch_env"]


@dataclass(frozen=True)
class LaunchEnv:
    """rank / local_rank: this process; world_size: processes of the job (None when not launched by
    torchrun or Slurm); launcher: ``"torchrun"``, ``"slurm"`` or ``"single"``."""

    rank: int
    world_size: Optional[int]
    local_rank: int
    launcher: str


def launch_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Read the launcher's variables from ``environ`` (default ``os.environ``).

    Raises:
        ValueError: a variable that is not an integer.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm")
    return LaunchEnv(0, None, 0, "single")
