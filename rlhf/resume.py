"""Which checkpoint a run resumes from (``trainer.resume_mode`` / ``trainer.resume_from_path``), decided from the
file system alone (no torch): ``--cfg`` and the trainer's start refuse a bad path before any model is built.

``trainer.resume_from_path`` may name

    a checkpoint              <run>/checkpoints/global_step_N   (holds trainer_state.pt)
    a checkpoints directory   <run>/checkpoints                 (its latest, per latest_checkpointed_iteration.txt;
                                                                 verl's trainer.default_local_dir is one)
    a run directory           <run>                             (the latest under <run>/checkpoints)

With ``resume_mode=auto`` a given resume_from_path is used; without one, the latest checkpoint under
``<trainer.default_local_dir>/checkpoints``, if any (verl's ``resume_mode=resume_path`` + ``resume_from_path``
spelling works the same).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Optional

log = logging.getLogger(__name__)

__all__ = ["TRACKER", "STATE_FILE", "RESUME_HINT", "resolve_resume_path", "resume_problems", "latest_in",
           "complete_checkpoints", "is_resume_option", "WRITE_ORDER"]

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"  # written last into a checkpoint (rlhf/trainer/checkpoint.py)
WRITE_ORDER = "write_order.txt"  # in each global_step_<k>: its place in the order checkpoints were written
RESUME_HINT = ("to resume, set trainer.resume_from_path=<run>/checkpoints/global_step_N (or the checkpoints "
               "directory, for its latest checkpoint)")
_RESUME_WORDS = re.compile(r"ckpt|checkpoint|resume|load_dir|load_path|restore", re.IGNORECASE)


def is_resume_option(name: str) -> bool:
    """True for an option or key name that looks like a way to resume (``--ckpt_path``,
    ``resume_from_checkpoint``, ``trainer.load_dir``): its error points at :data:`RESUME_HINT`."""
    return bool(_RESUME_WORDS.search(name))


def latest_in(root: str) -> Optional[str]:
    """The checkpoint the tracker file of checkpoints directory `root` names; else None.

    A tracker that names a folder no longer there (removed by hand to roll back, or by a tool) or that cannot be
    read does not silently start the run afresh: the newest complete checkpoint in `root` by write order (then
    step) is used, with a warning naming both; None only when `root` holds no complete checkpoint.
    """
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    try:
        with open(tracker) as f:
            named = os.path.join(root, f"global_step_{int(f.read().strip())}")
    except ValueError:
        named = None
    if named is not None and os.path.isdir(named):
        return named
    complete = complete_checkpoints(root)
    if complete:
        log.warning("%s names %s, which is not there; resuming from the newest complete checkpoint written, %s "
                    "(set trainer.resume_from_path to pick another, or trainer.resume_mode=disable to start afresh)",
                    tracker, named or "an unreadable step", complete[-1])
        return complete[-1]
    return None


def complete_checkpoints(root: str) -> list[str]:
    """The ``global_step_<k>`` folders under `root` that hold :data:`STATE_FILE`, oldest first by write order
    (``write_order.txt``; 0 when unreadable), then step."""
    ranked = []
    for name in _steps_in(root):
        path = os.path.join(root, name)
        if not os.path.isfile(os.path.join(path, STATE_FILE)):
            continue
        try:
            with open(os.path.join(path, WRITE_ORDER)) as f:
                order = int(f.read().strip())
        except (OSError, ValueError):
            order = 0
        ranked.append((order, int(name.rsplit("_", 1)[1]), path))
    return [path for _, _, path in sorted(ranked)]


def _steps_in(root: str) -> list[str]:
    try:
        return sorted((n for n in os.listdir(root) if re.fullmatch(r"global_step_\d+", n)),
                      key=lambda n: int(n.rsplit("_", 1)[1]))
    except OSError:
        return []


def _from_path(path: str) -> str:
    """The checkpoint `path` names (see the module docstring).  Raises FileNotFoundError saying what is wrong."""
    shown = f"trainer.resume_from_path={path!r}"
    if not os.path.exists(path):
        raise FileNotFoundError(f"{shown}: no such directory; {RESUME_HINT}.")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{shown} is a file, not a checkpoint directory; {RESUME_HINT}.")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    if re.fullmatch(r"global_step_\d+(\.tmp|\.deleting)?", os.path.basename(os.path.normpath(path))):
        raise FileNotFoundError(f"{shown} is not a complete checkpoint (no {STATE_FILE}: the save did not finish); "
                                f"resume from an earlier one, e.g. trainer.resume_from_path="
                                f"{os.path.dirname(os.path.normpath(path))} for the latest complete one.")
    for root in (path, os.path.join(path, "checkpoints")):
        found = latest_in(root)
        if found is not None:
            if not os.path.isfile(os.path.join(found, STATE_FILE)):
                raise FileNotFoundError(f"{shown}: its latest checkpoint {found} has no {STATE_FILE} (not saved by "
                                        f"this trainer, e.g. a verl checkpoint, or incomplete); {RESUME_HINT}.")
            return found
    steps = _steps_in(path) or _steps_in(os.path.join(path, "checkpoints"))
    listed = f" (it holds {', '.join(steps[-3:])} but no {TRACKER})" if steps else ""
    raise FileNotFoundError(f"{shown} holds no checkpoint{listed}; {RESUME_HINT}.")


def resolve_resume_path(mode: str, resume_from_path: Optional[str], default_local_dir: str) -> Optional[str]:
    """The checkpoint directory to resume from, or None to start fresh (module docstring).

    Args:
        mode: ``trainer.resume_mode`` (auto, resume_path, disable).
        resume_from_path: ``trainer.resume_from_path`` (or None).
        default_local_dir: ``trainer.default_local_dir``.

    Raises:
        ValueError: resume_mode=resume_path without a path.
        FileNotFoundError: a resume_from_path that names no checkpoint (missing, empty, an unfinished save).
    """
    mode = str(getattr(mode, "value", mode))
    if mode == "disable":
        return None
    if resume_from_path:
        return _from_path(str(resume_from_path))
    if mode == "resume_path":
        raise ValueError(f"trainer.resume_mode=resume_path needs a checkpoint; {RESUME_HINT}.")
    return latest_in(os.path.join(default_local_dir, "checkpoints"))


def resume_problems(trainer_cfg) -> list[str]:
    """The resume settings' problem as one line (for rlhf.config.validate), or []."""
    try:
        resolve_resume_path(trainer_cfg.resume_mode, trainer_cfg.resume_from_path, trainer_cfg.default_local_dir)
    except (ValueError, FileNotFoundError) as e:
        return [str(e)]
    return []
