"""The memory plan at the command line (``python -m rlhf.main ... --plan-memory[=GIB]``) and at trainer start.

    code, text = plan_memory_report(cfg)           # 0 fits, 2 does not fit / no config.json; text = the table
    check_plan_at_start(cfg, hf_config, world_size=8)   # on GPU: one warning with the knobs when it does not fit

The model's shape comes from ``config.json`` alone (a local HF directory, or a hub name already in the
local HF cache, else that one file is fetched): no weights are read; with ``distill.enable`` the teacher's
(``distill.teacher.path``) too.  The GPU count is
``trainer.n_gpus_per_node x trainer.nnodes`` (default: this machine's CUDA devices, else 8 per node), the
trainer's those less the disaggregated engines' (``rollout.num_engines x rollout.tensor_model_parallel_size``;
``rlhf.main --plan-memory`` first refuses a job whose engines and trainer do not fit those GPUs, through the
config check's placement rule); the GPU size is the ``--plan-memory=GIB`` value, else this machine's first CUDA device, else 80 GiB.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from rlhf.memory_plan.planner import GiB, MemoryPlan, format_plan
from rlhf.memory_plan.from_config import _get, _value, check_memory_plan, plan_from_config

logger = logging.getLogger(__name__)

DEFAULT_GPU_GIB = 80.0
DEFAULT_GPUS_PER_NODE = 8
EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 2


def read_hf_config_json(path: str) -> dict:
    """``config.json`` of `path`: a local model directory (or the file itself), else a hub name (the local HF
    cache first, then that one file from the hub).  Raises FileNotFoundError naming the path and the fix."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if path.startswith("tiny://") or os.path.isabs(path) or path.startswith("."):
        raise FileNotFoundError(f"model.path={path!r} has no config.json to plan from; the plan is for GPU runs: "
                                f"give model.path=<an HF model directory or hub name>")
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json")
        found = found if isinstance(found, str) else hf_hub_download(path, "config.json")
        with open(found, encoding="utf-8") as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated: one message with the fix
        raise FileNotFoundError(f"model.path={path!r}: cannot read its config.json ({type(e).__name__}); give "
                                f"model.path=<a local HF model directory> (only config.json is read)") from None


def teacher_hf_config(cfg: Any) -> dict | None:
    """``config.json`` of on-policy distillation's teacher (``distill.teacher.path``) when ``distill.enable``, else
    None.  Raises FileNotFoundError as :func:`read_hf_config_json` (naming distill.teacher.path)."""
    if not _get(cfg, "distill.enable", False):
        return None
    path = str(_get(cfg, "distill.teacher.path", ""))
    try:
        return read_hf_config_json(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(str(e).replace("model.path=", "distill.teacher.path=", 1)) from None


def cuda_gpu_gib() -> float | None:
    """Total memory of this machine's first CUDA device in GiB, None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GiB
    except Exception:  # noqa: BLE001 - a broken driver plans like a machine without GPUs
        return None
    return None


def planned_gpus(cfg: Any) -> tuple[int, int]:
    """(GPUs per node, nodes) of the job: ``trainer.n_gpus_per_node`` (unset: this machine's CUDA devices,
    else 8) and ``trainer.nnodes`` (default 1); the disaggregated engines' GPUs included, except with verl's pools
    (``rollout.n_gpus_per_node``: trainer.* is the trainer's pool alone)."""
    per_node = _get(cfg, "trainer.n_gpus_per_node")
    if not per_node:
        try:
            import torch

            per_node = torch.cuda.device_count() or DEFAULT_GPUS_PER_NODE
        except Exception:  # noqa: BLE001
            per_node = DEFAULT_GPUS_PER_NODE
    return int(per_node), int(_get(cfg, "trainer.nnodes") or 1)


def engine_gpus(cfg: Any) -> int:
    """GPUs the disaggregated engines take beside the trainer's: ``rollout.num_engines x
    rollout.tensor_model_parallel_size`` (0 colocated; the same rule as rlhf.rollout.placement.engine_gpus)."""
    if str(_value(_get(cfg, "rollout.mode", "colocated"))) != "disaggregated" or _get(cfg, "rollout.n_gpus_per_node"):
        return 0  # colocated, or verl's pools: trainer.* counts the trainer's GPUs alone
    return int(_get(cfg, "rollout.num_engines", 1)) * int(_get(cfg, "rollout.tensor_model_parallel_size", 1))


def planned_world_size(cfg: Any) -> int:
    """Trainer GPUs: :func:`planned_gpus` less the disaggregated engines' (:func:`engine_gpus`); < 1 when they
    leave none (:func:`plan_memory_report` refuses it; ``rlhf.main --plan-memory`` also checks the placement,
    rlhf.config.validate)."""
    per_node, nnodes = planned_gpus(cfg)
    return per_node * nnodes - engine_gpus(cfg)


def plan_memory_report(cfg: Any, gpu_memory_gib: float | None = None, hf_config: Any = None,
                       world_size: int | None = None) -> tuple[int, str]:
    """(exit code, text) of ``--plan-memory``: 0 and the per-GPU table when every phase fits, 2 and the table
    with the knob of each failing phase when one does not, 2 and the reason when the plan cannot be made
    (no config.json, a layout that does not divide the GPUs, disaggregated engines that leave the trainer no
    GPU: checked before config.json is read).  hf_config: default ``model.path``'s
    config.json; gpu_memory_gib: default this machine's GPU, else 80; world_size: `planned_world_size`."""
    try:
        world, engines = world_size or planned_world_size(cfg), engine_gpus(cfg)
        if world < 1:
            per_node, nnodes = planned_gpus(cfg)
            raise ValueError(f"rollout.mode=disaggregated: rollout.num_engines x rollout.tensor_model_parallel_size = "
                             f"{engines} GPUs of the {per_node * nnodes} (trainer.nnodes x trainer.n_gpus_per_node = "
                             f"{nnodes} x {per_node}) leave none for the trainer; lower rollout.num_engines, add GPUs, "
                             f"or use rollout.mode=colocated")
        hf = hf_config if hf_config is not None else read_hf_config_json(str(_get(cfg, "model.path", "")))
        gib = float(gpu_memory_gib or cuda_gpu_gib() or DEFAULT_GPU_GIB)
        plan = plan_from_config(cfg, hf, world_size=world, gpu_memory_gib=gib, teacher_hf_config=teacher_hf_config(cfg))
    except (FileNotFoundError, ValueError, KeyError) as e:
        return EXIT_DOES_NOT_FIT, f"cannot plan memory: {str(e).strip(chr(39))}"
    head = (f"{world} GPUs of {gib:.0f} GiB (trainer.n_gpus_per_node x trainer.nnodes"
            f"{f' less the engines {engines}' if engines and not world_size else ''}; GPU size: --plan-memory=GIB)")
    return (EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT), head + "\n" + format_plan(plan)


def check_plan_at_start(cfg: Any, hf_config: Any, world_size: int, cuda: bool | None = None,
                        strict: bool = False) -> MemoryPlan | None:
    """The trainer's start check.  On GPU (`cuda` default: torch.cuda.is_available()): plan this run on this
    machine's GPU size and warn (strict: raise MemoryPlanError) with the table and the knobs when a phase
    does not fit.  On CPU: one debug line, None.  A config the planner cannot read is one warning, never an
    error (the plan is advice).  Returns the plan."""
    gib = cuda_gpu_gib() if cuda is None or cuda else None
    if cuda is False or (cuda is None and gib is None):
        logger.debug("memory plan: skipped (no CUDA device)")
        return None
    try:
        from parallel.kernels import module_available

        plan = plan_from_config(cfg, hf_config, world_size=world_size, gpu_memory_gib=gib or DEFAULT_GPU_GIB,
                                transformer_engine=module_available("transformer_engine"),
                                teacher_hf_config=teacher_hf_config(cfg))
    except (ValueError, KeyError, FileNotFoundError) as e:
        logger.warning("memory plan: not made (%s)", e)
        return None
    return check_memory_plan(plan, strict=strict)
