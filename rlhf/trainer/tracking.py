"""Metrics tracking on global rank 0: the backends of ``trainer.logger`` (rlhf.trainer.loggers) behind one
``log(metrics, step)``.

A metrics dict holds floats, and may hold two kinds of media, which :meth:`Tracking.log` takes out of the dict
(the trainer's returned metrics stay scalars) and writes where the backend can:

    metrics["critic/score/hist"] = Histogram(scores)                         # TensorBoard, wandb
    metrics["val/generations"] = Table(["prompt", "response", "score"], rows)  # all (TensorBoard as text)

``trainer.log_freq``: scalars of every `log_freq`-th step are written, and those of any step with validation
metrics; the last step that was skipped is written by :meth:`Tracking.close`, so a run's final values are always
there (the media of skipped steps are dropped).  ``trainer.project_name`` / ``experiment_name`` name the wandb project / run and the mlflow experiment /
run; TensorBoard writes to ``<default_local_dir>/tensorboard``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from .loggers import BACKENDS, ConsoleLogger, MlflowLogger, TensorBoardLogger, WandbLogger

__all__ = ["Tracking", "Histogram", "Table"]


@dataclass
class Histogram:
    """Values [N] (any 1-D sequence of numbers) to show as a distribution."""

    values: Any


@dataclass
class Table:
    """A table: column names and rows (sequences of cells: str / int / float)."""

    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]


class Tracking:
    """``log(metrics, step)`` to every backend of `backends` (rlhf.trainer.loggers.BACKENDS); nothing when not
    `enabled` (ranks other than 0).  `log_dir` is TensorBoard's directory; wandb / mlflow write under its parent
    (the run directory) unless `run_dir` is given.  `config` (a plain dict) is stored as the wandb config and as
    mlflow params.

    Raises:
        ValueError: an unknown backend.  RuntimeError: wandb without credentials (see WandbLogger).
        ImportError: the package of a chosen backend is missing.
    """

    BACKENDS = BACKENDS

    def __init__(self, log_dir: str, backends=("console", "tensorboard"), enabled: bool = True, *,
                 project_name: str = "rlhf", experiment_name: str = "run", log_freq: int = 1,
                 config: dict | None = None, run_dir: str | None = None):
        backends = [str(b) for b in ([backends] if isinstance(backends, str) else backends)]
        bad = [b for b in backends if b not in self.BACKENDS]
        if bad:
            raise ValueError(f"trainer.logger has unknown backends {bad}; use {list(self.BACKENDS)}")
        if log_freq < 1:
            raise ValueError(f"trainer.log_freq={log_freq} must be >= 1")
        self.enabled, self.log_freq, self.backends = enabled, int(log_freq), {}
        self.pending: tuple[dict, int] | None = None
        if not enabled:
            return
        run_dir = run_dir or os.path.dirname(os.path.abspath(log_dir))
        for b in backends:
            if b == "console":
                self.backends[b] = ConsoleLogger()
            elif b == "tensorboard":
                self.backends[b] = TensorBoardLogger(log_dir)
            elif b == "wandb":
                self.backends[b] = WandbLogger(project_name, experiment_name, run_dir, config)
            else:
                self.backends[b] = MlflowLogger(project_name, experiment_name, run_dir, config)

    @classmethod
    def from_config(cls, cfg, enabled: bool) -> "Tracking":
        """The tracker of a composed config: ``trainer.{logger, project_name, experiment_name, log_freq}``,
        TensorBoard in ``<trainer.default_local_dir>/tensorboard``."""
        from omegaconf import OmegaConf

        t = cfg.trainer
        return cls(os.path.join(t.default_local_dir, "tensorboard"), backends=list(t.logger), enabled=enabled,
                   project_name=t.project_name, experiment_name=t.experiment_name, log_freq=t.get("log_freq", 1),
                   config=OmegaConf.to_container(cfg, resolve=True) if enabled else None)

    @property
    def writer(self):
        """The TensorBoard SummaryWriter, or None."""
        tb = self.backends.get("tensorboard")
        return tb.writer if tb is not None else None

    def log(self, metrics: dict, step: int) -> None:
        """Write `metrics` at `step` (see the module docstring for media and ``log_freq``).  The media entries
        are removed from `metrics` on every rank."""
        media = {k: metrics.pop(k) for k in [k for k, v in metrics.items() if isinstance(v, (Histogram, Table))]}
        if not self.enabled:
            return
        due = step % self.log_freq == 0 or any(k.startswith("val/") for k in metrics)
        if not due:
            self.pending = (dict(metrics), step)
            return
        self.pending = None
        self._write(metrics, media, step)

    def _write(self, metrics: dict, media: dict, step: int) -> None:
        for backend in self.backends.values():
            backend.scalars(metrics, step)
            for name, item in media.items():
                if isinstance(item, Histogram):
                    backend.histogram(name, item.values, step)
                else:
                    backend.table(name, item.columns, item.rows, step)

    def close(self) -> None:
        """Write the last step skipped by ``log_freq``, then close every backend."""
        if self.pending is not None:
            metrics, step = self.pending
            self.pending = None
            self._write(metrics, {}, step)
        for backend in self.backends.values():
            backend.close()
        self.backends = {}
