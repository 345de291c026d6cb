"""Metrics: TensorBoard event files and a console line, on global rank 0 only."""
from __future__ import annotations

import os


class Tracking:
    """`log(metrics, step)` writes scalars to `<log_dir>` (TensorBoard) and/or prints them.

    backends: subset of {"console", "tensorboard"}; raises ValueError for others.
    """

    BACKENDS = ("console", "tensorboard")

    def __init__(self, log_dir: str, backends=("console", "tensorboard"), enabled: bool = True):
        bad = [b for b in backends if b not in self.BACKENDS]
        if bad:
            raise ValueError(f"trainer.logger has unknown backends {bad}; use {list(self.BACKENDS)}")
        self.enabled = enabled
        self.console = "console" in backends
        self.writer = None
        if enabled and "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict, step: int) -> None:
        """Write every metric as a scalar at `step`; print a fixed selection on the console."""
        if not self.enabled:
            return
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, float(v), step)
            self.writer.flush()
        if self.console:
            keys = ["critic/score/mean", "val/score", "actor/pg_loss", "critic/vf_loss", "actor/kl",
                    "response_length/mean", "dapo/num_gen_batches", "reward/num_fallbacks", "dpo/loss",
                    "dpo/accuracy", "val/preference_accuracy", "timing/step"]
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
            print(f"step {step}: {shown}", flush=True)

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self.writer is not None:
            self.writer.close()
