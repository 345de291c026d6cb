"""Trainer checkpoints: atomic, resumable, the last `max_ckpt_to_keep` kept.

Layout under `<default_local_dir>/checkpoints/`::

    global_step_<k>/actor/        dist_checkpointing: actor model + optimizer (any TP/PP layout)
    global_step_<k>/critic/       same for the critic (when there is one)
    global_step_<k>/trainer_state.pt   step, LR schedulers, KL controller, dataloader position, model summary
    global_step_<k>/rng/rank_<r>.pt    python / numpy / torch RNG states of every rank
    global_step_<k>/write_order.txt    when it was written: 1 + the largest of the folder's other checkpoints
    latest_checkpointed_iteration.txt  written last (tmp + fsync + rename), like verl's tracker

A checkpoint is written into `global_step_<k>.tmp/` and renamed when every rank has finished,
then the tracker file is replaced: a crash at any point leaves either the previous complete
checkpoint or the new one, never one that looks complete but is not.  A folder is only ever
deleted under another name (`global_step_<k>.deleting/`: an older checkpoint past
`max_ckpt_to_keep`, or one being replaced), so a `global_step_<k>` folder is always complete.
Stale `.tmp` / `.deleting` folders are removed on the next save.

Rotation goes by write order, not by step (:func:`rotate`): the `max_ckpt_to_keep` checkpoints written last
stay, so the one just written always does, and the tracker (what ``trainer.resume_mode=auto`` reads) names it.
By step, a folder holding higher steps of an earlier run (``trainer.resume_mode=disable``, or
``resume_from_path`` pointing at an older checkpoint) made every new save the "oldest": deleted as soon as
written, with the tracker left naming a missing folder, so auto-resume started again from step 0.  Like verl
(its checkpoint manager deletes the paths it saved, in save order; the tracker names the last save), but the
order is kept in the folders, so it also holds across restarts.  Folders without a write order (saved before it
existed, or copied in) count as written before every other, oldest step first.

Slim checkpoints (``trainer.slim_checkpoint``, default true) keep only what resuming needs
(parallel.dist_checkpoint.save_sharded); full ones also hold recomputable copies.  Either loads.
"""
from __future__ import annotations

import enum
import logging
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from rlhf import faults
from parallel.dist_checkpoint import load_sharded, save_sharded
from rlhf.resume import TRACKER, WRITE_ORDER, latest_in

logger = logging.getLogger(__name__)

STALE_SUFFIXES = (".tmp", ".deleting")
# config.json fields that must match between a checkpoint and the model it is loaded into
MODEL_SUMMARY_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")


def model_summary(hf_config) -> dict:
    """The fields of an HF config that fix the checkpoint's tensors (MODEL_SUMMARY_KEYS), as builtins."""
    return {k: to_builtins(getattr(hf_config, k, None)) for k in MODEL_SUMMARY_KEYS}


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
    return latest_in(root)


def _mid_save_fault_point():
    """With ``RLHF_FAULT=ckpt_mid_save``: the hook that kills the run after a role's tensor files are written
    and before its metadata.json (a kill in the middle of a sharded save)."""
    return lambda checkpoint_dir: faults.maybe_fail("ckpt_mid_save", dir=checkpoint_dir)


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _delete(path: str) -> None:
    """Remove a checkpoint folder: renamed first (atomic), so a crash never leaves a partial global_step_<k>."""
    if os.path.exists(path):
        doomed = path + ".deleting"
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _write_tracker(root: str, step: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def save_checkpoint(root: str, step: int, roles: dict, trainer_state: dict, max_to_keep: int | None,
                    slim: bool = True) -> str:
    """Collective. `roles` maps a name ("actor", "critic") to a TrainState; `slim` see the module docstring.
    Returns the final path."""
    rank = dist.get_rank()
    final = os.path.join(root, f"global_step_{step}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.endswith(STALE_SUFFIXES):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    dist.barrier()
    mid_save = _mid_save_fault_point() if faults.armed("ckpt_mid_save") else None
    for name, state in roles.items():
        save_sharded(os.path.join(tmp, name), state.model, state.optimizer,
                     common={"scheduler": to_builtins(state.scheduler.state_dict())}, slim=slim,
                     after_tensor_files=mid_save)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    if rank == 0:
        torch.save(dict(trainer_state, step=step), os.path.join(tmp, "trainer_state.pt"))
    dist.barrier()
    if rank == 0:
        faults.maybe_fail("ckpt_before_rename", step=step)
        _delete(final)  # a leftover of a run that died after its rename, before its tracker update (or a rerun's)
        with open(os.path.join(tmp, WRITE_ORDER), "w") as f:
            f.write(str(1 + max((order for order, _ in _checkpoints(root).values()), default=0)))
        os.replace(tmp, final)
        faults.maybe_fail("ckpt_before_tracker", step=step)
        _write_tracker(root, step)
        if max_to_keep:
            rotate(root, max_to_keep, keep=step)
    dist.barrier()
    return final


def _checkpoints(root: str) -> dict:
    """``{folder name: (write order, step)}`` of the ``global_step_<k>`` folders under `root`; write order 0 for a
    folder without a readable write_order.txt."""
    out = {}
    for name in os.listdir(root):
        m = re.fullmatch(r"global_step_(\d+)", name)
        if m is None:
            continue
        try:
            with open(os.path.join(root, name, WRITE_ORDER)) as f:
                order = int(f.read().strip())
        except (OSError, ValueError):
            order = 0
        out[name] = (order, int(m.group(1)))
    return out


def rotate(root: str, max_to_keep: int, keep: int | None = None) -> list[int]:
    """Delete all but the `max_to_keep` checkpoints under `root` written last (module docstring: by write order,
    then step), never ``global_step_<keep>`` (the one just written).  Returns the deleted steps, in write order;
    a warning names those of higher step than `keep` (an earlier run's, in the same folder)."""
    ranked = sorted(_checkpoints(root).items(), key=lambda item: item[1])
    doomed = [(name, step) for name, (_, step) in ranked[:max(len(ranked) - max_to_keep, 0)] if step != keep]
    for name, _ in doomed:
        _delete(os.path.join(root, name))
    later = [step for _, step in doomed if keep is not None and step > keep]
    if later:
        logger.warning("deleted checkpoints %s of %s: written before global_step_%d (an earlier run in this "
                       "folder), so older by write order (max_ckpt_to_keep=%d); to keep an earlier run's "
                       "checkpoints, give each run its own trainer.default_local_dir", ", ".join(
                           f"global_step_{s}" for s in later), root, keep, max_to_keep)
    return [step for _, step in doomed]


def check_model(path: str, saved: dict | None, expected: dict | None) -> None:
    """Raise ValueError when the checkpoint at `path` was saved for another model (model_summary differs)."""
    if not saved or not expected:
        return
    diff = {k: (saved.get(k), expected.get(k)) for k in expected if saved.get(k) != expected.get(k)}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {path!r} was saved for another model ({shown}). Resume it with the model it "
                         "was trained from (model.path), or start fresh: another trainer.default_local_dir, or "
                         "trainer.resume_mode=disable.")


def read_model_summary(path: str) -> dict | None:
    """The model summary saved in the checkpoint at `path` (None for a checkpoint from before it was saved).
    Raises FileNotFoundError when `path` has no trainer_state.pt (not a complete checkpoint)."""
    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.exists(state_file):
        raise FileNotFoundError(f"{state_file} is missing; {path!r} is not a complete checkpoint")
    return torch.load(state_file, weights_only=False).get("model")


def load_checkpoint(path: str, roles: dict, model: dict | None = None) -> dict:
    """Collective. Restores every role's model/optimizer/scheduler and this rank's RNG; returns the
    trainer state saved by rank 0.  `model` (model_summary of the model being trained) is checked against
    the checkpoint's before any tensor is read.

    Raises FileNotFoundError naming a missing part; ValueError for a checkpoint of another model.
    """
    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.exists(state_file):
        raise FileNotFoundError(f"{state_file} is missing; {path!r} is not a complete checkpoint")
    trainer_state = torch.load(state_file, weights_only=False)
    check_model(path, trainer_state.get("model"), model)
    for name, state in roles.items():
        common = load_sharded(os.path.join(path, name), state.model, state.optimizer)
        state.scheduler.load_state_dict(common["scheduler"])
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if os.path.exists(rng_file):  # absent when resuming with a different world size
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state
