"""Process-wide logging for a training job: standard :mod:`logging` with time and rank, written through
``tqdm.write`` so log lines never overwrite the progress bar, and the known-harmless library warnings that
greet every run filtered out.

    setup_logging(rank)       # python -m rlhf.main / rlhf.Trainer.run() call it once per rank

Line format: ``2026-01-01 12:00:00,123 [rank 0] INFO rlhf.trainer.tracking: step 1: ...``.  Rank 0 logs at INFO,
the other ranks at WARNING (their INFO lines would repeat rank 0's); ``RLHF_LOG_LEVEL`` (DEBUG, INFO, WARNING, ...)
sets the level of every rank.

Filtered (:data:`KNOWN_HARMLESS_WARNINGS`, :data:`QUIET_LOGGERS`, on CPU :data:`CPU_ONLY_WARNINGS`), each for the
reason given there; set
``RLHF_SHOW_ALL_WARNINGS=1`` to see them all again.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["setup_logging", "filter_known_warnings", "TqdmHandler", "KNOWN_HARMLESS_WARNINGS", "QUIET_LOGGERS",
           "CPU_ONLY_WARNINGS", "LOG_FORMAT"]

LOG_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"

#: (message regex, category, module regex, why) of Python warnings that say nothing a user can act on
KNOWN_HARMLESS_WARNINGS = (
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\.",
     "megatron-core announces its torch fallbacks once per module (4 lines x 2 each); without TE the fallbacks "
     "are what runs, on CPU always"),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.",
     "megatron-core's LayerNorm fallback, announced by two modules"),
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning, r"megatron\.",
     "raised by megatron-core's own TransformerConfig default, whatever our settings"),
)

#: logger name -> level: library loggers whose lower-level records are noise for a training job
QUIET_LOGGERS = {
    # "No CUDA runtime is found, using CUDA_HOME=..." at import on every CPU-only process
    "torch.utils.cpp_extension": logging.ERROR,
    # "Token authentication is enabled for this Ray cluster": the trainer's own local cluster, nothing to do
    "ray._private.authentication.authentication_token_setup": logging.ERROR,
    # megatron-core's set-up chatter at INFO: DDP / optimizer config dumps and the parameter list of every
    # gradient bucket (~40 lines per trainable role); its warnings still show
    "megatron.core": logging.WARNING,
}

#: (message regex, category, module regex, why) filtered only on machines without CUDA
CPU_ONLY_WARNINGS = (
    (r"When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONN",
     UserWarning, r"megatron\.", "a CUDA stream setting; there are no CUDA streams on CPU"),
)

#: environment defaults: datasets' progress bars for tiny file writes ("Creating parquet from Arrow format")
QUIET_ENV = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class TqdmHandler(logging.StreamHandler):
    """A stream handler that writes through ``tqdm.write``: an active progress bar is cleared, the line
    printed, and the bar redrawn below it (plain writes otherwise)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def filter_known_warnings() -> None:
    """Install the filters of :data:`KNOWN_HARMLESS_WARNINGS` and :data:`QUIET_LOGGERS` (idempotent; a no-op
    with ``RLHF_SHOW_ALL_WARNINGS=1``).  Call it before the libraries are imported: most of these warnings are
    raised at import time."""
    if os.environ.get("RLHF_SHOW_ALL_WARNINGS") == "1":
        return
    for message, category, module, _why in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def setup_logging(rank: int = 0, level: str | int | None = None, stream=None, force: bool = True) -> None:
    """Configure the root logger for this process: one :class:`TqdmHandler` on `stream` (default stderr) with
    :data:`LOG_FORMAT` (replacing one an earlier call added); the level is `level`, else ``RLHF_LOG_LEVEL``, else
    INFO on rank 0 and WARNING on the others.  With ``force=False`` a root logger that already has other handlers
    (the application configured logging) is left alone.  Also calls :func:`filter_known_warnings`.

    Raises:
        ValueError: an unknown level name.
    """
    filter_known_warnings()
    if os.environ.get("RLHF_SHOW_ALL_WARNINGS") != "1":
        import torch

        if not torch.cuda.is_available():
            for message, category, module, _why in CPU_ONLY_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category, module=module)
    root = logging.getLogger()
    others = [h for h in root.handlers if not isinstance(h, TqdmHandler)]
    if others and not force:
        return
    level = level or os.environ.get("RLHF_LOG_LEVEL") or ("INFO" if rank == 0 else "WARNING")
    if isinstance(level, str) and not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"log level {level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL (RLHF_LOG_LEVEL)")
    for h in list(root.handlers):
        if isinstance(h, TqdmHandler):  # ours from an earlier call; other handlers (e.g. a test's) are kept
            root.removeHandler(h)
    handler = TqdmHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_RankFilter(rank))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)  # the warnings that remain go through the same handler, with rank and time
