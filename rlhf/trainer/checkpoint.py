"""Trainer checkpoints: atomic, resumable, the last `max_ckpt_to_keep` kept.

Layout under `<default_local_dir>/checkpoints/`::

    global_step_<k>/actor/        dist_checkpointing: actor model + optimizer (any TP/PP layout)
    global_step_<k>/critic/       same for the critic (when there is one)
    global_step_<k>/trainer_state.pt   step, LR schedulers, KL controller, dataloader position
    global_step_<k>/rng/rank_<r>.pt    python / numpy / torch RNG states of every rank
    latest_checkpointed_iteration.txt  written last (tmp + rename), like verl's tracker

A checkpoint is written into `global_step_<k>.tmp/` and renamed when every rank has finished,
then the tracker file is replaced: a crash at any point leaves either the previous complete
checkpoint or the new one, never one that looks complete but is not. Stale `.tmp` folders are
removed on the next save.
"""
from __future__ import annotations

import enum
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from rlhf.mcore.dist_checkpoint import load_sharded, save_sharded

TRACKER = "latest_checkpointed_iteration.txt"


def to_builtins(x):
    """`x` with every Enum replaced by its value, through dicts, lists and tuples.  megatron reads a
    checkpoint's common state with ``torch.load(weights_only=True)``, which refuses any class outside
    the builtins it allows -- an Enum (e.g. a StrEnum ``lr_decay_style`` in the scheduler state) included."""
    if isinstance(x, enum.Enum):
        return to_builtins(x.value)
    if isinstance(x, dict):
        return {k: to_builtins(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_builtins(v) for v in x)
    return x


def checkpoint_root(default_local_dir: str) -> str:
    """``<default_local_dir>/checkpoints``: where the ``global_step_<k>`` folders and the tracker file live."""
    return os.path.join(default_local_dir, "checkpoints")


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under `root` (per the tracker file), or None."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    step = int(open(tracker).read().strip())
    path = os.path.join(root, f"global_step_{step}")
    return path if os.path.isdir(path) else None


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str, step: int, roles: dict, trainer_state: dict, max_to_keep: int | None) -> str:
    """Collective. `roles` maps a name ("actor", "critic") to a TrainState. Returns the final path."""
    rank = dist.get_rank()
    final = os.path.join(root, f"global_step_{step}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    dist.barrier()
    for name, state in roles.items():
        save_sharded(os.path.join(tmp, name), state.model, state.optimizer,
                     common={"scheduler": to_builtins(state.scheduler.state_dict())})
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    if rank == 0:
        torch.save(dict(trainer_state, step=step), os.path.join(tmp, "trainer_state.pt"))
    dist.barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))
        if max_to_keep:
            steps = sorted(int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"global_step_(\d+)", n)))
            for old in steps[:-max_to_keep]:
                shutil.rmtree(os.path.join(root, f"global_step_{old}"), ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str, roles: dict) -> dict:
    """Collective. Restores every role's model/optimizer/scheduler and this rank's RNG; returns the
    trainer state saved by rank 0. Raises FileNotFoundError naming a missing part."""
    for name, state in roles.items():
        common = load_sharded(os.path.join(path, name), state.model, state.optimizer)
        state.scheduler.load_state_dict(common["scheduler"])
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if os.path.exists(rng_file):  # absent when resuming with a different world size
        _set_rng_state(torch.load(rng_file, weights_only=False))
    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.exists(state_file):
        raise FileNotFoundError(f"{state_file} is missing; the checkpoint is incomplete")
    return torch.load(state_file, weights_only=False)
