"""verl's ``<role>.megatron.*`` keys (the Megatron worker: parallel layout, ``override_transformer_config``,
``override_optimizer_config``) and verl's defaults that read as "not set": rules for :mod:`rlhf.config.verl.keys`.

``override_transformer_config.<field>`` sets a field of megatron-core's ``TransformerConfig`` in verl.  Here a
field with an equivalent is mapped to our key (which reaches the TransformerConfig through
:func:`parallel.model_config.transformer_config_from_hf`), a fused-kernel or throughput switch is accepted
without effect (the kernels are chosen by ``parallel.kernels`` where they import), and every other field is
refused as not supported, naming it.
"""
from __future__ import annotations

from typing import Any, Callable

from parallel.optim_config import megatron_dtype_name

__all__ = ["Unsupported", "megatron_rules", "optimizer_rules", "VERL_DEFAULTS", "is_verl_default",
           "MEGATRON_DTYPES", "dtype_rule"]


class Unsupported(ValueError):
    """A verl setting with no equivalent here; the message says why and what to use instead."""


#: megatron-core OptimizerConfig precision fields (the precision-aware optimizer)
MEGATRON_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def dtype_rule(key: str) -> Callable[[Any], list]:
    """``fn`` rule: a verl dtype spelling -> megatron's name at our ``key`` (verl's null: megatron's fp32 default)."""
    def fn(v: Any) -> list[tuple[str, Any]]:
        return [] if v is None else [(key, megatron_dtype_name(v))]
    return fn

_OFF = (False, None, 0, "", {}, [])


def _train_dtype(v: Any) -> list[tuple[str, Any]]:
    """verl's ``megatron.dtype`` (the training dtype) -> model.dtype; float16 refused (megatron's fp16 training needs
    its loss scaler, which is not wired here)."""
    if str(v).lower() in ("float16", "fp16", "half"):
        raise Unsupported("fp16 training (megatron's dynamic loss scaling) is not supported; train in bfloat16 "
                          "(model.dtype=bfloat16) and serve in float16 if wanted (rollout.dtype=float16)")
    return [("model.dtype", v)]


def _recompute(v: Any) -> list[tuple[str, Any]]:
    if v in (None, "full", "selective"):
        return [("parallel.recompute", v)]
    raise Unsupported("parallel.recompute is null, full or selective")


def _load_balancing(v: Any) -> list[tuple[str, Any]]:
    if v in (None, "aux_loss"):
        return []  # the router's aux loss, its coefficient model.moe_aux_loss_coef
    if v == "none":
        return [("model.moe_aux_loss_coef", 0.0)]  # no load-balancing loss
    raise Unsupported("the MoE router balances its load with the aux loss (aux_loss, or none: "
                      "model.moe_aux_loss_coef=0)")


def _router_dtype(v: Any) -> list[tuple[str, Any]]:
    if v in (None, "fp32", "fp64"):
        return [("model.moe_router_dtype", v)]
    raise Unsupported("model.moe_router_dtype is null, fp32 or fp64")


#: override_transformer_config fields with an equivalent here: field -> (action, arg)
_TRANSFORMER_MAPPED = {
    "num_layers_in_first_pipeline_stage": ("map", "parallel.num_layers_in_first_pipeline_stage"),
    "num_layers_in_last_pipeline_stage": ("map", "parallel.num_layers_in_last_pipeline_stage"),
    "account_for_embedding_in_pipeline_split": ("map", "parallel.account_for_embedding_in_pipeline_split"),
    "account_for_loss_in_pipeline_split": ("map", "parallel.account_for_loss_in_pipeline_split"),
    "moe_aux_loss_coeff": ("map", "model.moe_aux_loss_coef"),
    "moe_z_loss_coeff": ("map", "model.moe_z_loss_coeff"),
    "moe_router_dtype": ("fn", _router_dtype),
    "moe_router_load_balancing_type": ("fn", _load_balancing),
    "recompute_granularity": ("fn", _recompute),
    "sequence_parallel": ("map", "parallel.sequence_parallel"),
}
#: fields accepted at the value this trainer uses: field -> (values, why)
_TRANSFORMER_NEUTRAL = {
    "recompute_method": ((None, "uniform"), "parallel.recompute=full recomputes every layer (uniform, 1 layer)"),
    "recompute_num_layers": ((None, 1), "parallel.recompute=full recomputes every layer (uniform, 1 layer)"),
    "recompute_modules": ((None, ["core_attn"]), "parallel.recompute=selective recomputes the attention core"),
    "moe_token_dispatcher_type": ((None, "alltoall"), "experts exchange tokens by all-to-all (no DeepEP / flex "
                                                      "dispatcher)"),
    "moe_enable_deepep": ((False, None), "DeepEP is not supported"),
    "moe_router_enable_expert_bias": ((False, None), "aux-loss-free expert-bias routing is not supported"),
    "pipeline_model_parallel_layout": ((None, ""), "give uneven pipelines as num_layers_in_first/last_pipeline_stage"),
    "normalization": (("RMSNorm", None), "the norm comes from the model's config.json (RMSNorm)"),
    "swiglu": ((True, None), "the MLP comes from the model's config.json (SwiGLU)"),
}
#: kernel-fusion and throughput switches: chosen by parallel.kernels / megatron-core, results unchanged
_TRANSFORMER_KERNELS = (
    "attention_backend use_flash_attn apply_rope_fusion masked_softmax_fusion bias_activation_fusion "
    "bias_dropout_fusion gradient_accumulation_fusion persist_layer_norm moe_permute_fusion moe_grouped_gemm "
    "moe_shared_expert_overlap deallocate_pipeline_outputs use_fused_swiglu use_fused_rmsnorm "
    "cross_entropy_loss_fusion moe_router_fusion").split()
_CP_ONLY = "context_parallel_algo cp_partition_mode".split()
#: override_optimizer_config fields of megatron's own optimizer offload / precision-aware optimizer: our
#: <role>.optim keys of the same names
OFFLOAD_OPTIMIZER_FIELDS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "use_precision_aware_optimizer")
#: override_optimizer_config fields that are fields of our OptimConfig under the same name
_OPTIMIZER_SAME_NAME = "lr min_lr weight_decay adam_beta1 adam_beta2 adam_eps clip_grad use_distributed_optimizer"


def transformer_rules(at: str, same: bool) -> list[tuple]:
    """Rules for ``<at>.override_transformer_config.*``: the actor's set our keys; the reference's and critic's
    (which run in the actor's layout) must equal them."""
    tc = f"{at}.override_transformer_config"
    rules: list[tuple] = []
    for name, (action, arg) in _TRANSFORMER_MAPPED.items():
        if same:
            if action == "map":
                rules.append((f"{tc}.{name}", "same", arg))
            else:
                rules.append((f"{tc}.{name}", "ignore", "the actor's setting applies (actor_rollout_ref.actor."
                                                        "megatron.override_transformer_config)"))
        else:
            rules.append((f"{tc}.{name}", action, arg))
    rules += [(f"{tc}.{n}", "neutral", v) for n, v in _TRANSFORMER_NEUTRAL.items()]
    rules += [(f"{tc}.{n}", "ignore", "a fused-kernel / throughput switch: kernels are chosen by parallel.kernels "
                                      "where they import, with the same results") for n in _TRANSFORMER_KERNELS]
    rules += [(f"{tc}.{n}", "ignore", "a context-parallel algorithm detail: megatron-core's default split (p2p) "
                                      "applies (parallel.context_parallel_size)") for n in _CP_ONLY]
    rules += [(tc, "neutral", (_OFF, "give the fields one by one (override_transformer_config.<field>)")),
              (f"{tc}.*", "refuse", "this TransformerConfig field has no setting here (the transformer is built from "
                                    "the model's config.json; supported fields: docs/verl.md)")]
    return rules


def optimizer_rules(at: str, ours: str) -> list[tuple]:
    """Rules for ``<at>.override_optimizer_config.*`` (megatron's OptimizerConfig fields)."""
    oc = f"{at}.override_optimizer_config"
    rules: list[tuple] = [(f"{oc}.{n}", "map", f"{ours}.{n}") for n in OFFLOAD_OPTIMIZER_FIELDS]
    rules += [(f"{oc}.{n}", "fn", dtype_rule(f"{ours}.{n}")) for n in MEGATRON_DTYPES]
    rules += [(f"{oc}.overlap_cpu_optimizer_d2h_h2d", "ignore",
               "a HybridDeviceOptimizer copy-overlap knob; megatron's default applies")]
    rules += [(f"{oc}.{n}", "map", f"{ours}.{n}") for n in _OPTIMIZER_SAME_NAME.split()]
    rules += [(f"{oc}.decoupled_weight_decay", "neutral", ((True, None), "weight decay is decoupled (AdamW)")),
              (f"{oc}.optimizer", "neutral", (("adam", None), "the optimizer is megatron's Adam (AdamW)")),
              (oc, "neutral", (_OFF, f"give the fields one by one (override_optimizer_config.<field>) or set "
                                     f"{ours}.*")),
              (f"{oc}.*", "refuse", "this OptimizerConfig field has no setting here (supported: "
                                    f"{', '.join(_OPTIMIZER_SAME_NAME.split())} and {ours}.*)")]
    return rules


def _offload(at: str, ours: dict) -> list[tuple]:
    """``<role>.megatron.{param,grad,optimizer}_offload`` -> our keys ``ours[part]`` (None: the role has no such
    part, accepted without effect)."""
    return [(f"{at}.{part}_offload", "map", key) if key else
            (f"{at}.{part}_offload", "ignore", "the reference has no gradients or optimizer")
            for part, key in ours.items()]


def _init_weights(at: str, ours: str, same: bool) -> list[tuple]:
    """``<role>.megatron.use_dist_checkpointing`` / ``dist_checkpointing_path``: the role's initial weights from a
    megatron dist checkpoint, our ``<ours>.*`` keys of the same names (the reference's must equal the actor's: it
    is the initial actor)."""
    kind = "same" if same and ours == "actor" else "map"
    return [(f"{at}.use_dist_checkpointing", kind, f"{ours}.use_dist_checkpointing"),
            (f"{at}.dist_checkpointing_path", kind, f"{ours}.dist_checkpointing_path"),
            (f"{at}.dist_checkpointing_prefix", "neutral", (("", None), "checkpoints whose tensor names carry a "
                                                                        "prefix (NeMo's 'module.') are not read"))]


def megatron_rules(at: str, same: bool, offload: dict, init: str) -> list[tuple]:
    """``<role>.megatron.*``: the actor's sets our parallel layout; the reference's and critic's must equal it.
    `offload`: the role's offload keys (see :func:`_offload`); `init`: the section of our keys for the role's
    initial weights (``actor`` for the actor and the reference, ``critic``)."""
    kind = "same" if same else "map"
    return [
        *_offload(at, offload),
        (f"{at}.tensor_model_parallel_size", kind, "parallel.tensor_model_parallel_size"),
        (f"{at}.pipeline_model_parallel_size", kind, "parallel.pipeline_model_parallel_size"),
        (f"{at}.virtual_pipeline_model_parallel_size", kind, "parallel.virtual_pipeline_model_parallel_size"),
        (f"{at}.context_parallel_size", kind, "parallel.context_parallel_size"),
        (f"{at}.expert_model_parallel_size", kind, "parallel.expert_model_parallel_size"),
        (f"{at}.expert_tensor_parallel_size", "neutral", ((1, None), "experts are split over TP")),
        *_init_weights(at, init, same),
        *transformer_rules(at, same),
        (f"{at}.override_ddp_config", "neutral", (_OFF, "DDP settings are fixed here")),
        (f"{at}.override_mcore_model_config", "neutral", (_OFF, "the model is built from its HF config.json")),
        (f"{at}.sequence_parallel", kind if not same else "ignore", "parallel.sequence_parallel"),
        (f"{at}.use_distributed_optimizer", "map" if not same else "ignore",
         "actor.optim.use_distributed_optimizer" if not same else "the optimizer of its role decides"),
        (f"{at}.dtype", "fn", _train_dtype) if not same else (f"{at}.dtype", "ignore", "model.dtype applies"),
        (f"{at}.**", "ignore", "a verl Megatron-worker detail (seed, mbridge, checkpoint paths, ...)"),
    ]


#: verl's own defaults (its trainer config directory) for keys that here must agree with another setting: a
#: config file's value equal to these reads as "not set" (the user did not choose it), so verl's
#: ``critic.megatron.tensor_model_parallel_size: 1`` does not conflict with an actor at TP 2, nor does verl's
#: FSDP-only ``enable_gradient_checkpointing: true`` turn megatron recompute on.  On the command line every
#: value counts.
VERL_DEFAULTS: list[tuple[str, tuple]] = [
    *[(f"{role}.megatron.{n}", (1,)) for role in ("actor_rollout_ref.ref", "critic")
      for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "context_parallel_size")],
    *[(f"{role}.megatron.virtual_pipeline_model_parallel_size", (None,)) for role in ("actor_rollout_ref.ref",
                                                                                       "critic")],
    *[(f"{role}.megatron.override_transformer_config.{n}", (None, False)) for role in ("actor_rollout_ref.ref",
                                                                                        "critic")
      for n in _TRANSFORMER_MAPPED],
    ("actor_rollout_ref.ref.megatron.use_dist_checkpointing", (False,)),
    ("actor_rollout_ref.ref.megatron.dist_checkpointing_path", (None,)),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", (True, False)),
    ("critic.model.enable_gradient_checkpointing", (True, False)),
]


def is_verl_default(key: str, value: Any) -> bool:
    """True when a config file's ``key: value`` is verl's default for a key listed in :data:`VERL_DEFAULTS`."""
    for k, values in VERL_DEFAULTS:
        if k == key:
            return any(value == v and type(value) is type(v) for v in values)
    return False
