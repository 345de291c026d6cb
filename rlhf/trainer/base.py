"""The skeleton every trainer shares: :meth:`BaseTrainer.fit`.

    init distributed -> resume -> [validate] -> for each step: train_step (profiled when listed in
    global_profiler.steps) -> metrics -> validate every test_freq -> checkpoint every save_freq -> log the step's
    metrics -> HF export -> close

A subclass builds its parts in ``__init__`` (after ``super().__init__``: ``self.actor``,
``self.train_loader``, ``self.total_steps``) and implements :meth:`train_step` and :meth:`validate`;
it extends the checkpoint contents through :meth:`checkpoint_roles`, :meth:`trainer_state` and
:meth:`load_trainer_state`, and :meth:`close` for what it owns.  Every trainer rank (torchrun or srun,
one per device) runs the same code: megatron work is SPMD, rank 0 alone logs and prints.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Optional

import torch.distributed as dist

from rlhf import faults
from parallel.distributed import compute_device, init_distributed, init_model_parallel, set_seed
from parallel.kernels import resolve_kernels
from parallel.model_config import check_context_parallel
from rlhf.resume import resolve_resume_path
from rlhf.memory_plan.cli import check_plan_at_start
from parallel.step_guard import SkippedStepsError
from rlhf.workers.build import load_hf_config, load_tokenizer, resolve_model_path

from .alerts import Alerts
from .checkpoint import check_model, checkpoint_root, model_summary, read_model_summary
from .checkpoint import load_checkpoint as load_checkpoint_dir
from .checkpoint import save_checkpoint as save_checkpoint_dir
from .metrics import add_step_timing, timer
from .profiling import StepProfiler
from .tracking import Tracking

logger = logging.getLogger(__name__)

__all__ = ["BaseTrainer"]


def _due(freq: int, step: int, total: int) -> bool:
    """Every `freq` steps and at the last one; never when freq <= 0."""
    return freq > 0 and (step % freq == 0 or step == total)


class BaseTrainer:
    """Distributed state, model path, tokenizer and HF config, metrics tracker; the fit loop.

    Attributes set here: cfg, model_path, tokenizer, hf_config, tracker, alerts (``trainer.alerts`` and the
    safeguard event lines, rlhf.trainer.alerts), start_step (0 until resumed).
    """

    progress_desc = "train"
    progress_postfix: tuple[str, str] | None = None  # (label, metric) shown on the progress bar

    def __init__(self, cfg):
        self.cfg = cfg
        self.start_step = 0
        t = cfg.trainer  # a resume path that names no checkpoint fails here, before anything starts
        self.resume_path = resolve_resume_path(t.resume_mode, t.resume_from_path, t.default_local_dir)
        p = cfg.parallel
        init_distributed()
        init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                            p.virtual_pipeline_model_parallel_size, p.expert_model_parallel_size,
                            cp=p.context_parallel_size)
        check_context_parallel(p.context_parallel_size, resolve_kernels().use_te)  # before any model is built
        set_seed(cfg.trainer.seed)
        self.check_layout()
        out_dir = cfg.trainer.default_local_dir
        if dist.get_rank() == 0:
            os.makedirs(out_dir, exist_ok=True)
        self.model_path = resolve_model_path(cfg)
        self.tokenizer = load_tokenizer(cfg, self.model_path)
        self.hf_config = load_hf_config(self.model_path)
        if dist.get_rank() == 0:  # on GPU: a warning with the knob when a phase will not fit (CPU: a debug line)
            check_plan_at_start(cfg, self.hf_config, world_size=dist.get_world_size())
        self.resume_checkpoint()  # a checkpoint of another model is refused here, before any build
        self.tracker = None  # created by fit(): a run that fails to start leaves no TensorBoard file
        self.alerts = Alerts(cfg.trainer.alerts, {r: cfg[r].optim for r in ("actor", "critic")},
                             echo=dist.get_rank() == 0)

    # ---- what a trainer implements -------------------------------------------------------------
    def check_layout(self) -> None:
        """Raise ValueError for settings the parallel layout cannot run (before any model is built)."""

    def train_step(self, step: int) -> dict:
        """One optimisation step; returns its metrics plus ``_tokens`` (tokens processed, for throughput)."""
        raise NotImplementedError

    def validate(self) -> dict:
        """Validation metrics (``val/...``)."""
        raise NotImplementedError

    def checkpoint_roles(self) -> dict:
        """Name -> TrainState of everything trained (saved with dist_checkpointing)."""
        return {"actor": self.actor.state}

    def trainer_state(self) -> dict:
        """Picklable state saved by rank 0 next to the models."""
        return {"train_loader": self.train_loader.state_dict(), "alerts": self.alerts.state_dict()}

    def load_trainer_state(self, state: dict) -> None:
        """Restore :meth:`trainer_state` (models are already loaded)."""
        self.train_loader.load_state_dict(state["train_loader"])
        self.alerts.load_state_dict(state.get("alerts"))

    def close(self, finished: bool = False) -> None:
        """Release what the trainer holds (called once by :meth:`fit`, also on errors; ``finished``: the run
        ended normally on every rank, so a close may wait for the other ranks)."""
        if self.tracker is not None:
            self.tracker.close()

    # ---- the loop --------------------------------------------------------------------------------
    def steps_for(self, loader) -> int:
        """``trainer.total_training_steps``, or ``total_epochs`` passes over `loader`."""
        return self.cfg.trainer.total_training_steps or len(loader) * self.cfg.trainer.total_epochs

    def fill_lr_decay_steps(self, role: str, updates: int, epochs: int, batch: Optional[int] = None) -> None:
        """verl's default (verl/utils/megatron/optimizer.py get_megatron_optimizer_param_scheduler): a decaying
        ``<role>.optim.lr_decay_style`` with ``lr_decay_steps`` null decays over the whole run.  The schedule here
        counts optimizer steps, so that is `updates` x mini batches per update (data.train_batch_size /
        <role>.ppo_mini_batch_size; `batch` prompts per step when given: fully async) x `epochs`; a note on rank 0 says
        so.  Set before the role is built."""
        optim = self.cfg[role].optim
        if optim.lr_decay_steps is not None or str(optim.lr_decay_style) == "constant":
            return
        steps = max(updates, 1) * max((batch or self.cfg.data.train_batch_size) // self.cfg[role].ppo_mini_batch_size,
                                      1) * epochs
        optim.lr_decay_steps = steps
        if dist.get_rank() == 0:
            logger.info("%s.optim.lr_decay_steps=null with lr_decay_style=%s: decaying over the run's %d optimizer "
                        "steps (the last runs above min_lr)", role, optim.lr_decay_style, steps)

    def data_files(self, split: str):
        """``data.train_files`` ("train") or ``data.val_files`` as plain paths: quickstart tasks through the
        quickstart hook (collective), OmegaConf lists as python lists."""
        from omegaconf import OmegaConf

        from rlhf.quickstart.resolve import resolve_data

        files = resolve_data(self.cfg, split)
        return OmegaConf.to_container(files, resolve=True) if OmegaConf.is_config(files) else files

    def fit(self) -> dict:
        """Collective. Train from the latest checkpoint (``trainer.resume_mode``) to ``total_steps``, with
        torch.profiler traces of the ``global_profiler.steps`` (rlhf.trainer.profiling); returns the last step's
        metrics (the validation metrics when no step ran)."""
        t, last, finished = self.cfg.trainer, {}, False
        profiler = StepProfiler.from_config(self.cfg, dist.get_rank(), compute_device())
        try:
            self.tracker = Tracking.from_config(self.cfg, enabled=dist.get_rank() == 0)
            self.load_checkpoint()
            if t.val_before_train and self.start_step == 0:
                last = self.validate()
                self.tracker.log(last, 0)
            progress = self._progress_bar()
            for step in range(self.start_step + 1, self.total_steps + 1):
                faults.maybe_fail("step_start", step=step)
                with profiler.step(step):  # (a profiled step's time leaves out the trace export)
                    t0 = time.perf_counter()
                    metrics = self.run_step(step)
                    seconds = time.perf_counter() - t0
                add_step_timing(metrics, seconds, metrics.pop("_tokens"), dist.get_world_size())
                # verl's training/global_step and training/epoch (the pass over the prompts the step's batch is from)
                metrics.update({"training/global_step": float(step),
                                "training/epoch": float(self.train_loader.epoch)})
                if _due(t.test_freq, step, self.total_steps):
                    with timer(metrics, "testing"):  # verl's timing_s/testing
                        metrics.update(self.validate())
                self.alerts.check(metrics, step)
                metrics.update(self.alerts.metrics())
                if _due(t.save_freq, step, self.total_steps):  # saved before the step is logged, as verl does
                    with timer(metrics, "save_checkpoint"):  # verl's timing_s/save_checkpoint
                        self.save_checkpoint(step)
                self.tracker.log(metrics, step)
                last = metrics
                if progress is not None:
                    progress.update(1)
                    if self.progress_postfix is not None:
                        label, key = self.progress_postfix
                        progress.set_postfix({label: f"{metrics[key]:.3f}"})
            if progress is not None:
                progress.close()
            if t.export_hf_at_end:
                self.export_hf()
            finished = True
        finally:
            profiler.close()
            self.close(finished)
        return last

    def run_step(self, step: int) -> dict:
        """:meth:`train_step`; a SkippedStepsError (too many inf/NaN gradient steps in a row) is reported on one
        line (rank 0, stderr) with the step, then raised: the run ends non-zero."""
        try:
            return self.train_step(step)
        except SkippedStepsError as e:
            if dist.get_rank() == 0:
                logger.error("step %d: training stopped: %s", step, e)
            raise

    def _progress_bar(self):
        if dist.get_rank() != 0 or not self.cfg.trainer.progress_bar:
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.start_step, desc=self.progress_desc, dynamic_ncols=True)

    # ---- checkpoints / export --------------------------------------------------------------------
    @contextlib.contextmanager
    def roles_resident(self):
        """Every role's parameters, gradients and optimizer state on its device inside the block (those offloaded,
        ``<role>.offload``, leave again after it): what a checkpoint or an export reads and writes."""
        with contextlib.ExitStack() as stack:
            for name in ("actor", "reference", "critic"):
                worker = getattr(self, name, None)
                if worker is not None and hasattr(worker, "resident"):
                    stack.enter_context(worker.resident())
            yield

    def save_context(self):
        """Context manager around a checkpoint save that frees device memory for it (the save all-gathers the
        distributed optimizer's state over DP on the GPU: rlhf.memory_plan.planner.save_gather_bytes).  Here
        nothing; PPOTrainer releases its colocated rollout engines."""
        return contextlib.nullcontext()

    def save_checkpoint(self, step: int) -> str:
        """Collective. ``<default_local_dir>/checkpoints/global_step_<step>`` (rlhf.trainer.checkpoint), inside
        :meth:`save_context`; rank 0 logs ``saving checkpoint to <path>`` before and ``saved checkpoint <path>
        (step N, S s)`` after."""
        t, rank0 = self.cfg.trainer, dist.get_rank() == 0
        root = checkpoint_root(t.default_local_dir)
        if rank0:
            logger.info("saving checkpoint to %s", os.path.join(root, f"global_step_{step}"))
        t0 = time.perf_counter()
        state = dict(self.trainer_state(), model=model_summary(self.hf_config))
        with self.save_context(), self.roles_resident():
            path = save_checkpoint_dir(root, step, self.checkpoint_roles(), state, t.max_ckpt_to_keep,
                                       slim=t.slim_checkpoint)
        if rank0:
            logger.info("saved checkpoint %s (step %d, %.1f s); resume with trainer.resume_from_path=%s", path, step,
                        time.perf_counter() - t0, path)
        return path

    def resume_checkpoint(self) -> str | None:
        """:attr:`resume_path`, the checkpoint ``trainer.resume_mode`` / ``trainer.resume_from_path`` name
        (rlhf.resume.resolve_resume_path, run first thing in ``__init__``), after checking that it was
        saved for this model (config.json's shapes) without reading any tensor.

        Raises ValueError for a checkpoint of another model; FileNotFoundError for one without trainer_state.pt.
        """
        path = self.resume_path
        if path is not None:
            check_model(path, read_model_summary(path), model_summary(self.hf_config))
        return path

    def load_checkpoint(self) -> None:
        """Collective. Load :attr:`resume_path` (see :meth:`resume_checkpoint`), if any; sets ``start_step``.

        Raises FileNotFoundError for an incomplete checkpoint.
        """
        path = self.resume_path
        if path is None:
            return
        with self.roles_resident():  # (load_trainer_state may sync the loaded actor into the engines)
            state = load_checkpoint_dir(path, self.checkpoint_roles(), model=model_summary(self.hf_config))
            self.load_trainer_state(state)
        self.start_step = int(state["step"])
        if dist.get_rank() == 0:
            logger.info("resumed from %s at step %d", path, self.start_step)

    def export_hf(self) -> str:
        """Collective. The actor as an HF checkpoint (+ tokenizer) in ``<default_local_dir>/hf_export``; a LoRA
        actor's weights merged (W + alpha/r B A), and its adapter as a PEFT directory in ``hf_export_adapter``."""
        from parallel.convert import save_hf_checkpoint

        out = os.path.join(self.cfg.trainer.default_local_dir, "hf_export")
        with self.roles_resident():
            save_hf_checkpoint(self.actor.chunks, self.actor.bundle.spec, self.hf_config, out,
                               tokenizer=self.tokenizer)
            if getattr(self.actor, "lora", None) is not None:  # merged weights above; the adapter alone for PEFT
                from parallel.lora_export import save_peft_adapter

                save_peft_adapter(self.actor.chunks, self.actor.bundle.spec, self.actor.lora, out + "_adapter",
                                  base_model=self.model_path)
        return out
