"""The one hook between the quickstart fixtures and the core build path.

The trainer's build path (``rlhf.workers.build``, the trainers' data set-up) calls
:func:`resolve_model` and :func:`resolve_data` on every config; they return plain paths and leave
anything that is not a quickstart URI unchanged, so no other module knows these schemes:

* ``model.path=tiny://quickstart`` -> the warmed-up tiny model (:mod:`rlhf.quickstart.model`),
  built once under ``<trainer.default_local_dir>/tiny_model``; ``tiny://quickstart-init`` -> the same model
  before its warm-up (its initial weights, kept in a directory of its own);
* ``data.*_files=embedded://arithmetic`` -> parquet files of the arithmetic task
  (:mod:`rlhf.quickstart.arithmetic`) under ``<trainer.default_local_dir>/data``, in the form the
  quickstart model was warmed up on;
* ``model.path=tiny://calc`` / ``data.*_files=embedded://calc``: the same for the calculator tool task
  (:mod:`rlhf.quickstart.calc`; the model under ``tiny_model/tiny_calc_model``, the data under ``data/calc``);
* with ``algorithm.name=dpo``, ``embedded://preference`` (or ``embedded://arithmetic``) -> parquet
  files of preference pairs on that task.

Both functions are collective over the trainer job: global rank 0 builds / writes, the others wait
at a barrier, then every rank gets the same path.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["resolve_model", "resolve_data", "local_model_path", "EMBEDDED_SCHEME", "TINY_SCHEME",
           "QUICKSTART_MAX_POSITION_EMBEDDINGS"]

TINY_SCHEME = "tiny://"
EMBEDDED_SCHEME = "embedded://"
#: the context of tiny://quickstart (rlhf.quickstart.model; here for the config checks, which import no torch):
#: Qwen2.5's, so verl's commands (up to 2048 + 9632 tokens) run on it unchanged; RoPE has no weights, so the size
#: costs nothing but SGLang's cos/sin table (2 MB)
QUICKSTART_MAX_POSITION_EMBEDDINGS = 32768


def _rank0_then_all(fn):
    """Run `fn` on global rank 0, barrier, then on the other ranks (which reuse what rank 0 cached on disk)."""
    import torch.distributed as dist

    out = fn() if dist.get_rank() == 0 else None
    dist.barrier()
    return out if dist.get_rank() == 0 else fn()


def _rank0_only(fn) -> None:
    """Run `fn` on global rank 0 while the other ranks wait at a barrier."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def resolve_model(cfg, path: str | None = None) -> str:
    """`path` (default ``cfg.model.path``; also ``model.critic_path``, ``distill.teacher.path`` and reward-model
    paths) as a local path or hub name: ``tiny://quickstart`` is built (or reused) under
    ``trainer.default_local_dir/tiny_model`` with ``model.warmup_steps / warmup_lr`` and
    ``data.embedded_max_operand``, ``tiny://quickstart-init`` likewise with no warm-up; any other value is returned
    unchanged.

    Raises:
        ValueError: another ``tiny://`` name.
    """
    path = cfg.model.path if path is None else path
    if not (isinstance(path, str) and path.startswith(TINY_SCHEME)):
        return path
    from .model import resolve_model_path

    cache = os.path.join(cfg.trainer.default_local_dir, "tiny_model")
    return _rank0_then_all(lambda: resolve_model_path(
        path, cache, warmup_steps=cfg.model.warmup_steps, warmup_lr=cfg.model.warmup_lr,
        max_operand=cfg.data.embedded_max_operand))


def local_model_path(cfg, path: str | None = None) -> str | None:
    """What :func:`resolve_model` (then the trainer's hub download) would give for `path` (default
    ``cfg.model.path``), found without building, downloading or any collective: a local directory as it is,
    ``tiny://quickstart`` / ``tiny://quickstart-init`` when that model is built already; None otherwise (a hub name, a model to build)."""
    path = cfg.model.path if path is None else path
    if isinstance(path, str) and path.startswith(TINY_SCHEME):
        if path.rstrip("/") not in (TINY_SCHEME + "quickstart", TINY_SCHEME + "quickstart-init", TINY_SCHEME + "calc"):
            return None
        from .model import CALC_SCHEME, QUICKSTART_INIT_SCHEME, built_quickstart_model

        cache = os.path.join(cfg.trainer.default_local_dir, "tiny_model")
        if path.rstrip("/") == QUICKSTART_INIT_SCHEME:
            return built_quickstart_model(cache, init=True, max_operand=cfg.data.embedded_max_operand)
        return built_quickstart_model(cache, calc=path.rstrip("/") == CALC_SCHEME, warmup_steps=cfg.model.warmup_steps,
                                      warmup_lr=cfg.model.warmup_lr, max_operand=cfg.data.embedded_max_operand)
    return path if isinstance(path, str) and os.path.isdir(path) else None


def resolve_data(cfg, split: str) -> Any:
    """``cfg.data.train_files`` (split "train") or ``val_files`` (any other split) with an ``embedded://``
    task replaced by the path of its generated parquet file; other values are returned unchanged.

    ``data.embedded_num_train / embedded_num_val`` rows, seeded by ``data.seed`` (+1 for the
    validation split), operands up to ``data.embedded_max_operand``.

    Raises:
        ValueError: an unknown embedded task (the message lists the valid ones for the algorithm).
    """
    d = cfg.data
    files = d.train_files if split == "train" else d.val_files
    if not (isinstance(files, str) and files.startswith(EMBEDDED_SCHEME)):
        return files
    from .arithmetic import quickstart_task_kwargs

    out = os.path.join(cfg.trainer.default_local_dir, "data")
    task_kwargs = quickstart_task_kwargs(d.embedded_max_operand)
    if cfg.algorithm.name == "dpo":
        valid = ("embedded://preference", "embedded://arithmetic")
        if files not in valid:
            raise ValueError(f"data files {files!r}: the embedded preference pairs are {' or '.join(map(repr, valid))}")
        n = d.embedded_num_train if split == "train" else d.embedded_num_val
        path = os.path.join(out, f"preference_{'train' if split == 'train' else 'test'}.parquet")

        def write():
            from rlhf.data.preference import write_preference_parquet

            from .arithmetic import make_synthetic_preference_dataset

            rows = make_synthetic_preference_dataset(n, seed=d.seed + (split != "train"), **task_kwargs)
            write_preference_parquet(rows, path)
    elif files == "embedded://calc":  # the calculator tool task (rlhf.quickstart.calc), for tiny://calc
        out = os.path.join(out, "calc")
        path = os.path.join(out, "train.parquet" if split == "train" else "test.parquet")

        def write():
            from .calc import CALC_TASK, write_calc_parquet

            write_calc_parquet(out, d.embedded_num_train, d.embedded_num_val, seed=d.seed,
                               **quickstart_task_kwargs(d.embedded_max_operand, CALC_TASK))
    else:
        if files != "embedded://arithmetic":
            raise ValueError(f"data files {files!r}: the embedded tasks are 'embedded://arithmetic' and "
                             f"'embedded://calc'")
        path = os.path.join(out, "train.parquet" if split == "train" else "test.parquet")

        def write():
            from .arithmetic import write_arithmetic_parquet

            write_arithmetic_parquet(out, d.embedded_num_train, d.embedded_num_val, seed=d.seed, **task_kwargs)

    _rank0_only(write)
    return path
