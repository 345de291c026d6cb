"""The memory plan of a composed training config (``python -m rlhf.main ... --plan-memory``).

    from rlhf.memory_plan.from_config import plan_from_config, check_memory_plan
    plan = plan_from_config(cfg, hf_config, world_size=8, gpu_memory_gib=80)
    print(format_plan(plan))
    check_memory_plan(plan)      # MemoryPlanError with the knobs when a phase does not fit

Reads only plain values of the config (an OmegaConf DictConfig or a nested dict with the schema's
keys, `rlhf.config.schema`), so it imports neither torch nor the config package.
"""
from __future__ import annotations

import logging
from typing import Any

from rlhf.memory_plan.planner import (EngineSetup, GiB, Layout, MemoryPlan, PlanInput, Role, Workload, format_plan,
                                    plan_memory)
from rlhf.memory_plan.terms import ModelShape

logger = logging.getLogger(__name__)


class MemoryPlanError(ValueError):
    """The plan does not fit the GPU; the message lists each phase's peak and the knob to turn."""


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        try:
            node = node[part] if part in node else None
        except TypeError:
            node = getattr(node, part, None)
        if node is None:
            return default
    return node


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # Enum members -> their value


_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "uint8": 1}


def _optimizer_bytes(cfg: Any, o: str, precision: bool) -> dict:
    """Role fields of megatron's optimizer options under `o` (``actor.optim.``): the host share of
    optimizer_cpu_offload and, with the precision-aware optimizer, the bytes of main grads / params / moments."""
    def size(key: str) -> int:
        return _DTYPE_BYTES.get(str(_get(cfg, o + key, "fp32")).removeprefix("torch."), 4) if precision else 4

    host = float(_get(cfg, o + "optimizer_offload_fraction", 0.0)) if _get(cfg, o + "optimizer_cpu_offload") else 0.0
    return {"optimizer_host_fraction": host, "grad_bytes": size("main_grads_dtype"),
            "main_param_bytes": size("main_params_dtype"), "adam_bytes": size("exp_avg_dtype") + size("exp_avg_sq_dtype")}


def plan_input_from_config(cfg: Any, hf_config: Any, *, world_size: int, gpu_memory_gib: float = 80.0,
                           transformer_engine: bool = True, cuda: bool = True,
                           engine_memory_saver: bool = True, trainer_empty_cache: bool = True,
                           teacher_hf_config: Any = None) -> PlanInput:
    """PlanInput of the run `cfg` describes on `world_size` GPUs of `gpu_memory_gib` GiB each.

    hf_config: the model's config.json dict or transformers config.  transformer_engine: the GPU
    nodes have TE (flash attention, FusedAdam); False plans megatron's local spec and torch Adam.
    engine_memory_saver: SGLang releases its memory during the trainer's phases.  trainer_empty_cache:
    the trainer empties torch's cache before the engine resumes.  teacher_hf_config: the config.json of
    ``distill.teacher.path`` (with ``distill.enable``: the teacher is a role of its own model and grid).
    Raises ValueError when tp * cp * pp (or the teacher's tp * pp) does not divide world_size, or when distillation
    is on without teacher_hf_config.
    """
    tp = int(_get(cfg, "parallel.tensor_model_parallel_size", 1))
    pp = int(_get(cfg, "parallel.pipeline_model_parallel_size", 1))
    cp = int(_get(cfg, "parallel.context_parallel_size", 1))
    if world_size % (tp * pp * cp):
        raise ValueError(f"tp={tp} x cp={cp} x pp={pp} does not divide world_size={world_size}")
    dp = world_size // (tp * pp * cp)
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, vpp=_get(cfg, "parallel.virtual_pipeline_model_parallel_size"),
                    ep=int(_get(cfg, "parallel.expert_model_parallel_size", 1)),
                    sequence_parallel=bool(_get(cfg, "parallel.sequence_parallel", False)),
                    first_stage_layers=_get(cfg, "parallel.num_layers_in_first_pipeline_stage"),
                    last_stage_layers=_get(cfg, "parallel.num_layers_in_last_pipeline_stage"))
    algo = str(_value(_get(cfg, "algorithm.name", "ppo")))
    dpo = algo == "dpo"
    n = 2 if dpo else int(_get(cfg, "rollout.n", 1))  # sequences per prompt (DPO: a pair)
    seq = int(_get(cfg, "data.max_prompt_length")) + int(_get(cfg, "data.max_response_length"))

    def role(name: str, trainable: bool = True) -> Role:
        section = "actor" if name == "reference" else name
        micro_req = int(_get(cfg, f"{section}.ppo_micro_batch_size_per_gpu", 1))
        local_mini = max(1, int(_get(cfg, f"{section}.ppo_mini_batch_size", 1)) * n // dp)
        micro = max(1, min(micro_req, local_mini))
        if name == "reference":
            offload = ("params",) if _get(cfg, "actor.ref_param_offload", False) else ()
        else:
            offload = tuple(p for p in ("params", "grads", "optimizer") if _get(cfg, f"{section}.offload.{p}", False))
        o = f"{section}.optim."
        dist_opt = _get(cfg, o + "use_distributed_optimizer")
        precision = bool(_get(cfg, o + "use_precision_aware_optimizer", False))
        if dist_opt is None:  # the precision-aware optimizer runs as a distributed optimizer (parallel.optim)
            dist_opt = precision
        return Role(name=name, trainable=trainable, distributed_optimizer=bool(dist_opt),
                    micro_batch=micro, num_micro_batches=max(1, local_mini // micro), entropy=not dpo,
                    offload=offload, **_optimizer_bytes(cfg, o, precision))

    roles = [role("actor")]
    adv = str(_value(_get(cfg, "algorithm.adv_estimator", "gae")))
    critic = _get(cfg, "critic.enable")
    if not dpo and (critic if critic is not None else adv == "gae"):
        roles.append(role("critic"))
    if dpo or _get(cfg, "algorithm.use_kl_in_reward", False) or _get(cfg, "actor.use_kl_loss", False):
        roles.append(role("reference", trainable=False))
    if _get(cfg, "distill.enable", False) and not dpo:
        roles.append(_teacher_role(cfg, teacher_hf_config, layout, world_size, n))
    dtype = str(_value(_get(cfg, "model.dtype", "bfloat16")))
    params_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    engine = None
    if not dpo:
        rdtype = str(_value(_get(cfg, "rollout.dtype", "auto")))
        wbytes = params_bytes if rdtype == "auto" else (2 if rdtype in ("bfloat16", "float16") else 4)
        engine = EngineSetup(tp=int(_get(cfg, "rollout.tensor_model_parallel_size", 1)),
                             num_engines=int(_get(cfg, "rollout.num_engines", 1)),
                             mem_fraction_static=float(_get(cfg, "rollout.mem_fraction_static", 0.5)),
                             weight_bytes=wbytes, kv_bytes=wbytes,
                             colocated=str(_value(_get(cfg, "rollout.mode", "colocated"))) == "colocated",
                             memory_saver=engine_memory_saver,
                             sync_bucket_bytes=int(_get(cfg, "rollout.weight_sync_bucket_mb", 512)) << 20)
    local_prompts = max(1, int(_get(cfg, "data.train_batch_size", 1)) * n // dp)
    workload = Workload(seq_length=seq, temperature=float(_get(cfg, "rollout.temperature", 1.0)),
                        log_prob_micro_batch=max(1, min(int(_get(cfg, "actor.log_prob_micro_batch_size_per_gpu", 1)),
                                                        local_prompts)))
    return PlanInput(model=ModelShape.from_hf_config(hf_config), layout=layout, roles=tuple(roles),
                     workload=workload, gpu_bytes=gpu_memory_gib * GiB, num_gpus=world_size, engine=engine,
                     params_bytes=params_bytes, recompute=_value(_get(cfg, "parallel.recompute")),
                     flash_attention=transformer_engine, fused_adam=transformer_engine, cuda=cuda,
                     divisible_by=int(_get(cfg, "model.make_vocab_size_divisible_by", 128)),
                     trainer_empty_cache=trainer_empty_cache)


def _teacher_role(cfg: Any, hf_config: Any, trainer: Layout, world_size: int, n: int) -> Role:
    """On-policy distillation's teacher (rlhf.workers.teacher): frozen weights of its own model, on the trainer's
    grid or its own (``distill.teacher.tensor/pipeline_model_parallel_size``)."""
    if hf_config is None:
        raise ValueError(f"distill.enable=true: the plan needs the teacher's config.json (distill.teacher.path="
                         f"{_get(cfg, 'distill.teacher.path')!r})")
    t = "distill.teacher."
    tp = int(_get(cfg, t + "tensor_model_parallel_size") or trainer.tp)
    pp = int(_get(cfg, t + "pipeline_model_parallel_size") or trainer.pp)
    own = None
    if (tp, pp) != (trainer.tp, trainer.pp):
        if world_size % (tp * pp):
            raise ValueError(f"distill.teacher: tp={tp} x pp={pp} does not divide world_size={world_size}")
        own = Layout(tp=tp, pp=pp, dp=world_size // (tp * pp), sequence_parallel=trainer.sequence_parallel and tp > 1)
    dp = (own or trainer).dp
    micro = _get(cfg, t + "log_prob_micro_batch_size_per_gpu") or _get(cfg, "actor.log_prob_micro_batch_size_per_gpu",
                                                                          1)
    local = max(1, int(_get(cfg, "data.train_batch_size", 1)) * n // dp)
    return Role(name="teacher", trainable=False, offload=("params",) if _get(cfg, t + "param_offload") else (),
                micro_batch=max(1, min(int(micro), local)), model=ModelShape.from_hf_config(hf_config), layout=own)


def plan_from_config(cfg: Any, hf_config: Any, *, world_size: int, gpu_memory_gib: float = 80.0,
                     **kwargs) -> MemoryPlan:
    """The memory plan (rlhf.memory_plan.planner.plan_memory) of the composed config `cfg` on `world_size`
    GPUs of `gpu_memory_gib` GiB; keyword options as `plan_input_from_config`.  Print it with
    `format_plan`.  This is what ``--plan-memory`` calls."""
    return plan_memory(plan_input_from_config(cfg, hf_config, world_size=world_size, gpu_memory_gib=gpu_memory_gib,
                                              **kwargs))


def check_memory_plan(plan: MemoryPlan, strict: bool = True) -> MemoryPlan:
    """Refuse (strict: MemoryPlanError) or warn (log) when a phase does not fit; the message is the plan's
    table with the knob of each failing phase.  Returns the plan."""
    if plan.fits:
        return plan
    message = "the run does not fit in GPU memory:\n" + format_plan(plan)
    if strict:
        raise MemoryPlanError(message)
    logger.warning(message)
    return plan
