"""One class per metrics backend (``trainer.logger``), all with the same four methods:

    scalars(metrics: {name: float}, step)     histogram(name, values [N], step)
    table(name, columns, rows, step)          close()

``console`` (std logging, every scalar, one line per section), ``tensorboard`` (event files), ``wandb`` (a W&B run;
``WANDB_MODE=offline`` writes it locally for ``wandb sync``), ``mlflow`` (a run in ``MLFLOW_TRACKING_URI``, by
default the local file store ``<run dir>/mlruns``).  wandb and mlflow are optional extras
(``pip install rlhf-megatron-sglang[wandb]`` / ``[mlflow]``; ``rlhf.config.validate`` names a missing one before
the job starts).
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Sequence

__all__ = ["ConsoleLogger", "console_lines", "TensorBoardLogger", "WandbLogger", "MlflowLogger", "BACKENDS",
           "markdown_table", "mlflow_key"]

logger = logging.getLogger("rlhf.metrics")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], max_chars: int = 2000) -> str:
    """A markdown table (TensorBoard's text plugin renders it); cells cut at `max_chars`, ``|`` and newlines
    escaped."""
    def cell(v):
        s = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (list, dict)) else f"{v:.4g}" \
            if isinstance(v, float) else str(v)
        return s[:max_chars].replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def mlflow_key(name: str) -> str:
    """An mlflow-legal metric name: characters outside ``[A-Za-z0-9_\\-. /:]`` become ``_`` (``@`` -> ``_at_``)."""
    return re.sub(r"[^A-Za-z0-9_\-. /:]", "_", name.replace("@", "_at_"))


class ConsoleLogger:
    """Every scalar of a step, as verl's console logger prints them (verl/utils/logger/aggregate_logger.py:
    ``step:N - name:value - ...``), sorted by name, one line per section (the name's first part: actor, critic,
    perf, timing_s, val-core, ...) so a step reads as a short block::

        step 2: actor/entropy:0.5123 - actor/grad_norm:0.2011 - actor/kl:0.001 - ...
        step 2: critic/advantages/max:1.2 - ... - critic/score/mean:0.5 - ...

    Values with 4 significant digits (integers as integers).  At INFO on logger ``rlhf.metrics`` (printed
    through tqdm when logging is not configured); the first row of a table too."""

    def scalars(self, metrics: dict, step: int) -> None:
        for line in console_lines(metrics, step):
            self._emit(line)

    def histogram(self, name: str, values, step: int) -> None:
        pass

    def table(self, name: str, columns, rows, step: int) -> None:
        if rows:
            self._emit(f"step {step}: {name} ({len(rows)} rows), first: "
                       + "; ".join(f"{c}={str(v)[:200]!r}" for c, v in zip(columns, rows[0])))

    @staticmethod
    def _emit(line: str) -> None:
        if logging.getLogger().handlers:
            logger.info(line)
        else:
            from tqdm import tqdm

            tqdm.write(line)

    def close(self) -> None:
        pass


def console_lines(metrics: dict, step: int) -> list[str]:
    """:class:`ConsoleLogger`'s lines for `metrics` ({name: number}) at `step`: one per section, names sorted."""
    sections: dict[str, list[str]] = {}
    for k in sorted(metrics):
        sections.setdefault(k.split("/", 1)[0], []).append(f"{k}:{float(metrics[k]):.4g}")
    return [f"step {step}: " + " - ".join(items) for items in sections.values()]


class TensorBoardLogger:
    """Event files in `log_dir`: scalars, histograms, tables as markdown text."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, float(v), step)
        self.writer.flush()

    def histogram(self, name: str, values, step: int) -> None:
        import numpy as np

        self.writer.add_histogram(name, np.asarray(values, dtype=np.float64), step)

    def table(self, name: str, columns, rows, step: int) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb_credentials() -> bool:
    from rlhf.preflight import wandb_credentials

    return wandb_credentials()


class WandbLogger:
    """A W&B run: project `project`, run name `name`, files under `run_dir/wandb`, the config as its config.

    Raises:
        RuntimeError: no W&B credentials and not offline (the message says how to log in or go offline).
    """

    def __init__(self, project: str, name: str, run_dir: str, config: dict | None = None):
        if not _wandb_credentials():
            raise RuntimeError("trainer.logger includes wandb but no W&B credentials were found: set WANDB_API_KEY, "
                               "run `wandb login`, or set WANDB_MODE=offline (upload later with `wandb sync`)")
        import wandb

        os.makedirs(run_dir, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=run_dir, config=config or {}, reinit="create_new")

    def scalars(self, metrics: dict, step: int) -> None:
        self.run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def histogram(self, name: str, values, step: int) -> None:
        import numpy as np

        self.run.log({name: self.wandb.Histogram(np.asarray(values, dtype=np.float64))}, step=step)

    def table(self, name: str, columns, rows, step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An mlflow run named `name` in experiment `project`: metrics (names through :func:`mlflow_key`), tables
    as JSON artifacts ``<name>/step_<k>.json`` (``{"columns": [...], "data": [[...]]}``); mlflow has no
    histograms.  Tracking URI: ``MLFLOW_TRACKING_URI``, else the local file store ``<run_dir>/mlruns``."""

    def __init__(self, project: str, name: str, run_dir: str, config: dict | None = None):
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 asks before using ./mlruns
        import mlflow

        self.mlflow = mlflow
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=name)
        if config:
            flat = _flatten(config)
            for i in range(0, len(flat), 100):  # mlflow takes at most 100 params per call
                mlflow.log_params(dict(list(flat.items())[i:i + 100]))

    def scalars(self, metrics: dict, step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): float(v) for k, v in metrics.items()}, step=step)

    def histogram(self, name: str, values, step: int) -> None:
        pass

    def table(self, name: str, columns, rows, step: int) -> None:
        self.mlflow.log_dict({"columns": list(columns), "data": [list(r) for r in rows]},
                             f"{mlflow_key(name)}/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = str(v)[:500]
    return out


BACKENDS = ("console", "tensorboard", "wandb", "mlflow")
