"""Schema sections ``trainer`` (steps, logging, checkpoints, and the job's size) and ``global_profiler`` (verl's
section: which steps are profiled, rlhf/trainer/profiling.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlhf.config.choices import LoggerBackend, ResumeMode
from rlhf.config.schema.rules import Checked, check, ge, ge1_or_null, steps_or_never

__all__ = ["AlertConfig", "TrainerConfig", "GlobalProfilerConfig", "PROFILER_TOOLS"]

#: global_profiler.tool values (null: torch)
PROFILER_TOOLS = ("torch", "nsys")


@dataclass
class AlertConfig(Checked):
    """One entry of trainer.alerts (rlhf/trainer/alerts.py): a warning line with the step when `metric` is below
    `below` or above `above` (or not finite)."""
    metric: str = ""  # a step metric, e.g. actor/entropy, actor/kl, critic/score/mean
    below: Optional[float] = None
    above: Optional[float] = None

    def rules(self, at: str = "") -> list[str]:
        return ([] if self.metric else [f"{at}metric is empty; name a step metric, e.g. actor/entropy."]) + (
            [f"{at}below and {at}above are both null: give one or both (e.g. {{metric: actor/entropy, below: 0.05}})."]
            if self.below is None and self.above is None else [])


@dataclass
class TrainerConfig(Checked):
    project_name: str = "rlhf"  # wandb project / mlflow experiment
    experiment_name: str = "run"  # wandb / mlflow run name
    # checkpoints, TensorBoard, HF export; the run directory (.hydra/) unless hydra.run.dir is given, which sets it
    default_local_dir: str = "outputs/run"
    total_epochs: int = ge(1, 1)
    total_training_steps: Optional[int] = ge1_or_null(None, "null trains for {at}total_epochs")
    # console, tensorboard, wandb, mlflow: a list, or one name
    logger: list[LoggerBackend] = field(default_factory=lambda: [LoggerBackend.console, LoggerBackend.tensorboard])
    log_freq: int = ge(1, 1)  # write the step metrics to the loggers every this many steps
    log_val_generations: int = ge(0, 0)  # validation samples (prompt, response, score) logged as a table
    save_freq: int = steps_or_never(-1)
    test_freq: int = steps_or_never(-1)
    val_before_train: bool = True
    critic_warmup: int = ge(0, 0)  # first steps that train only the critic (the actor is not updated)
    # auto: the latest checkpoint under default_local_dir, or resume_from_path when given; resume_path: resume_from_path
    resume_mode: ResumeMode = ResumeMode.auto
    # a checkpoint (<run>/checkpoints/global_step_N), or a checkpoints directory / run directory (its latest)
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = ge1_or_null(2, "null keeps all")
    # true: checkpoints hold what resuming needs only (no recomputable fp32 copy of fp32 weights, no frozen weights);
    # false: full saves.  Either resumes bitwise.
    slim_checkpoint: bool = True
    export_hf_at_end: bool = True
    seed: int = 1
    progress_bar: bool = True
    # warning lines with the step when a metric crosses a threshold (rlhf/trainer/alerts.py), counted in
    # alerts/num_fired: [{metric: actor/entropy, below: 0.05}, {metric: actor/kl, above: 1.0}]
    alerts: list[AlertConfig] = field(default_factory=list)
    # the job's size (verl's keys): null = as launched (torchrun / Slurm); when set, `--cfg` checks the
    # data-parallel layout against n_gpus_per_node x nnodes and `rlhf launch` starts that many processes
    n_gpus_per_node: Optional[int] = ge1_or_null(None, "null: as launched")
    nnodes: Optional[int] = ge1_or_null(None, "null: as launched")

    def rules(self, at: str = "") -> list[str]:
        mode, rfp = self.resume_mode, self.resume_from_path
        out = [f"{at}resume_mode=resume_path needs {at}resume_from_path=<run>/checkpoints/global_step_N (a checkpoint, "
               f"or a checkpoints directory for its latest)."] if mode == ResumeMode.resume_path and not rfp else []
        out += [f"{at}resume_from_path={rfp!r} is ignored with {at}resume_mode=disable; set {at}resume_mode="
                f"resume_path (or drop resume_from_path)."] if rfp and mode == ResumeMode.disable else []
        return out + ([] if self.default_local_dir else [f"{at}default_local_dir is empty; give the output directory "
                                                         f"for checkpoints and logs."])


@dataclass
class GlobalProfilerConfig(Checked):
    """verl's ``global_profiler``: torch.profiler traces (or an nsys capture range) of the listed training steps
    (rlhf/trainer/profiling.py)."""
    # null or torch: torch.profiler traces; nsys: cudaProfilerStart/Stop + NVTX ranges
    tool: Optional[str] = check(None, lambda v: v in PROFILER_TOOLS, "is not supported here; use torch (trace files) "
                                "or nsys, or null", null=True)
    steps: Optional[list[int]] = None  # training steps to profile, e.g. [1, 5, 10]; null: none
    save_path: Optional[str] = None  # traces' directory; null: <trainer.default_local_dir>/profile
    # verl's: one trace over consecutive listed steps (not supported)
    profile_continuous_steps: bool = check(False, lambda v: not v, "is not supported: each listed step gets its own "
                                           "trace; set it to false")

    def rules(self, at: str = "") -> list[str]:
        bad = [s for s in (self.steps or []) if s is None or s < 1]
        return [f"{at}steps={list(self.steps)} holds {bad}: steps count from 1, e.g. {at}steps=[1,5,10]."] if bad else []
