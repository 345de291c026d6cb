"""Hugging Face config -> megatron-core TransformerConfig and GPTModel arguments.

Supported architectures are those of the converter registry (`parallel.convert.registry`, one
family file each: features there).  Every check runs
before any weight is allocated, so a bad layout fails in milliseconds with a message naming the
offending value and the fix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.convert.registry import get_converter, resolve_architecture, supported_architectures
from parallel.convert.spec import HFModelSpec, UnsupportedModelError
from parallel.kernels import resolve_kernels
from parallel.rope import SUPPORTED_ROPE_TYPES, rope_parameters

__all__ = ["HFModelSpec", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "hf_model_spec", "padded_vocab_size",
           "transformer_config_from_hf", "validate_parallel_layout"]

SUPPORTED_ARCHITECTURES = supported_architectures()
"""HF architecture names with a registered converter (`parallel.convert.registry`)."""


def hf_model_spec(hf_config) -> HFModelSpec:
    """Read a `transformers.PretrainedConfig` into an HFModelSpec.

    The architecture is looked up in the converter registry, whose family adds its own fields
    (bias, q/k norm, MoE).  Raises UnsupportedModelError for an architecture outside
    SUPPORTED_ARCHITECTURES, a non-SwiGLU activation or an unsupported RoPE scaling.
    """
    arch = resolve_architecture(hf_config)
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r}: only SwiGLU ('silu') MLPs are supported")
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError("use_sliding_window=True is not supported; set it to False")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    family = get_converter(arch)
    family_fields = family.spec_fields(hf_config, arch)
    rope_theta, rope_scaling = rope_parameters(hf_config, family.extra.get("rope_types", SUPPORTED_ROPE_TYPES))
    return HFModelSpec(
        architecture=arch, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads, num_query_groups=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), **family_fields)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: round vocab_size up to a multiple of divisible_by * tp."""
    multiple = make_vocab_size_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def validate_parallel_layout(spec: HFModelSpec, tp: int, pp: int, vpp: int | None = None,
                             num_layers_in_first_pipeline_stage: int | None = None,
                             num_layers_in_last_pipeline_stage: int | None = None, ep: int = 1,
                             etp: int | None = None, account_for_embedding_in_pipeline_split: bool = False,
                             account_for_loss_in_pipeline_split: bool = False) -> None:
    """Check that tp/pp(/vpp)/ep can shard this model; raises ValueError naming the value and the fix.

    `ep` is the expert-parallel size, `etp` the expert tensor-parallel size (default tp).
    Uneven pipelines: `num_layers_in_first/last_pipeline_stage` layers go to the first/last
    stage, the rest split evenly over the others (x vpp).  `account_for_embedding/loss_in_pipeline_split`
    count the embedding / the loss as one layer each in an even split (that stage builds one transformer
    layer less), so num_hidden_layers + those must divide pp (x vpp).  megatron-core only asserts some of
    these when building, and under `python -O` silently builds fewer layers, so we validate
    ourselves.
    """
    if spec.num_attention_heads % tp:
        raise ValueError(f"tensor parallel size tp={tp} does not divide num_attention_heads="
                         f"{spec.num_attention_heads}; choose tp from the divisors of both head counts")
    if spec.num_query_groups % tp:
        raise ValueError(f"tensor parallel size tp={tp} does not divide num_key_value_heads="
                         f"{spec.num_query_groups} (megatron shards whole query groups); use tp in "
                         f"{[d for d in range(1, spec.num_query_groups + 1) if spec.num_query_groups % d == 0]}")
    if spec.ffn_hidden_size % tp and (not spec.is_moe or spec.moe_dense_layers):
        raise ValueError(f"tp={tp} does not divide intermediate_size={spec.ffn_hidden_size}")
    if spec.moe_shared_ffn_hidden_size % tp:
        raise ValueError(f"tp={tp} does not divide the shared experts' intermediate size "
                         f"{spec.moe_shared_ffn_hidden_size}; choose tp dividing it")
    mla = spec.extra.get("megatron", {}) if spec.multi_latent_attention else {}
    for what, rows in (("q_lora_rank", mla.get("q_lora_rank")),
                       ("kv_lora_rank + qk_rope_head_dim", mla and mla["kv_lora_rank"] + mla["qk_pos_emb_head_dim"])):
        if rows and rows % tp:  # MLA down projections are column-parallel
            raise ValueError(f"tp={tp} does not divide {what}={rows} (megatron's column-parallel MLA down "
                             f"projection); choose tp dividing it")
    etp = tp if etp is None else etp
    if ep < 1 or (ep > 1 and not spec.is_moe):
        raise ValueError(f"expert parallel size ep={ep} needs a MoE model with experts to split "
                         f"({spec.architecture} has none); use ep=1")
    if spec.is_moe and spec.num_experts % ep:
        raise ValueError(f"expert parallel size ep={ep} does not divide num_experts={spec.num_experts}; use ep in "
                         f"{[d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]}")
    if spec.is_moe and spec.moe_ffn_hidden_size % etp:
        raise ValueError(f"expert tensor parallel size {etp} does not divide the experts' intermediate size "
                         f"{spec.moe_ffn_hidden_size}; choose tp (or expert_tensor_parallel_size) dividing it")
    if (num_layers_in_first_pipeline_stage or num_layers_in_last_pipeline_stage) and pp == 1:
        raise ValueError("num_layers_in_first/last_pipeline_stage need pipeline parallelism (pp > 1); unset them")
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    extra = int(bool(account_for_embedding_in_pipeline_split)) + int(bool(account_for_loss_in_pipeline_split))
    if extra and (first is not None or last is not None):
        raise ValueError("account_for_embedding/loss_in_pipeline_split cannot be combined with "
                         "num_layers_in_first/last_pipeline_stage (megatron-core refuses both); set one of them")
    if extra:
        chunks = pp * (vpp or 1)
        if (spec.num_layers + extra) % chunks or (spec.num_layers + extra) // chunks < extra:
            raise ValueError(f"num_hidden_layers={spec.num_layers} + {extra} (the embedding / loss counted as "
                             f"layers) does not split evenly over pp={pp}{f' x vpp={vpp}' if vpp else ''}; unset "
                             f"account_for_embedding/loss_in_pipeline_split or choose pp dividing "
                             f"{spec.num_layers + extra}")
        return
    middle_layers = spec.num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    chunks = middle_stages * (vpp or 1)
    if middle_layers < 0 or (middle_stages > 0 and middle_layers % chunks) or (middle_stages == 0 and middle_layers):
        raise ValueError(f"pipeline parallel size pp={pp}{f' x vpp={vpp}' if vpp else ''} does not divide "
                         f"num_hidden_layers={spec.num_layers}"
                         f"{f' (first stage {first}, last stage {last})' if first or last else ''}; "
                         f"choose pp dividing the layer count or set num_layers_in_first/last_pipeline_stage")


def check_context_parallel(cp: int, use_te: bool) -> None:
    """Refuse context parallelism where megatron-core cannot run it.

    megatron-core 0.16 splits attention over the CP ranks only inside Transformer Engine's
    `TEDotProductAttention` (its local `DotProductAttention` asserts ``context_parallel_size == 1``), so
    cp > 1 needs CUDA with Transformer Engine.  `use_te`: the kernel choice of this process
    (`parallel.kernels.resolve_kernels().use_te`).  Raises ValueError naming the setting and the fix.
    """
    if cp < 1:
        raise ValueError(f"context_parallel_size={cp}: must be >= 1")
    if cp > 1 and not use_te:
        raise ValueError(f"context_parallel_size={cp} needs Transformer Engine's attention on CUDA (megatron-core "
                         f"runs context parallelism only in TEDotProductAttention; this process uses the local "
                         f"spec: no GPU or no transformer_engine); set parallel.context_parallel_size=1 "
                         f"(actor_rollout_ref.actor.megatron.context_parallel_size=1) or run on GPUs with TE")


def transformer_config_from_hf(hf_config, tp: int = 1, pp: int = 1, vpp: int | None = None,
                               params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                               recompute: str | None = None, ep: int = 1,
                               num_layers_in_first_pipeline_stage: int | None = None,
                               num_layers_in_last_pipeline_stage: int | None = None,
                               moe_aux_loss_coeff: float | None = None, use_te: bool | None = None,
                               account_for_embedding_in_pipeline_split: bool = False,
                               account_for_loss_in_pipeline_split: bool = False,
                               moe_z_loss_coeff: float | None = None, moe_router_dtype: str | None = None,
                               cp: int = 1, moe_token_dispatcher_type: str = "alltoall",
                               moe_enable_deepep: bool = False, **overrides):
    """Build a megatron-core TransformerConfig matching the HF model numerics.

    Dropout is 0 (RLHF needs deterministic log-probs).  The fusions (masked softmax, SwiGLU, RoPE,
    gradient accumulation) are on only on CUDA with their extension importable (`parallel.kernels`;
    `use_te` as there: None checks that Transformer Engine is installed on GPU).
    `ep`: expert-parallel size (MoE; experts are also split over TP unless
    `expert_tensor_parallel_size` is overridden).  `num_layers_in_first/last_pipeline_stage`:
    uneven pipelines.  `cp`: context-parallel size (needs Transformer Engine's attention, see
    `check_context_parallel`).  `moe_aux_loss_coeff`: the router load-balancing loss coefficient
    (Switch-Transformer aux loss, Fedus et al. 2021, eq. 4); None takes the HF config's
    `router_aux_loss_coef`, 0 turns the loss off.  `moe_z_loss_coeff`: the router z-loss coefficient
    (None: off); `moe_router_dtype`: "fp32" / "fp64" routing precision (None: the model dtype); both
    only for MoE models.  `moe_token_dispatcher_type` / `moe_enable_deepep`: "alltoall", or "flex" (DeepEP, CUDA
    only: check_token_dispatcher in parallel.preflight refuses it on CPU or without deep_ep) for MoE models.
    `account_for_embedding/loss_in_pipeline_split`: see validate_parallel_layout.  MoE routing follows the HF model: softmax
    over the top-k logits when `norm_topk_prob` (Mixtral, Qwen3-MoE releases), else top-k of the
    softmax over all experts.  MoE with tp > 1 turns sequence parallelism on (megatron-core
    refuses MoE x TP without it).  A family's `spec.extra["megatron"]` fields come after these
    (DeepSeek-V3: MLA sizes, YaRN, sigmoid router); with ``multi_latent_attention`` the config is
    an MLATransformerConfig.  `overrides` are passed to the config last.
    Raises UnsupportedModelError / ValueError from hf_model_spec / validate_parallel_layout.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    spec = hf_model_spec(hf_config)
    validate_parallel_layout(spec, tp, pp, vpp, num_layers_in_first_pipeline_stage,
                             num_layers_in_last_pipeline_stage, ep=ep,
                             etp=overrides.get("expert_tensor_parallel_size"),
                             account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
                             account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split)
    kernels = resolve_kernels(use_te)
    check_context_parallel(cp, kernels.use_te)
    if spec.is_moe and tp > 1:
        sequence_parallel = True
    kw = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim, layernorm_epsilon=spec.rms_norm_eps, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, use_cpu_initialization=not torch.cuda.is_available(),
        persist_layer_norm=False,
        # batch_p2p_comm=True gives silently wrong results for interleaved PP=2 on gloo (the previous
        # and next peer are the same rank); unbatched p2p is exact everywhere.
        batch_p2p_comm=False,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        account_for_embedding_in_pipeline_split=bool(account_for_embedding_in_pipeline_split),
        account_for_loss_in_pipeline_split=bool(account_for_loss_in_pipeline_split),
        qk_layernorm=spec.qk_norm,
    )
    kw.update(kernels.fusions)  # fused kernels only where their extension imports (parallel.kernels)
    if spec.is_moe:
        coeff = spec.moe_aux_loss_coef if moe_aux_loss_coeff is None else float(moe_aux_loss_coeff)
        kw.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                  moe_router_topk=spec.moe_topk, moe_router_pre_softmax=not spec.moe_norm_topk_prob,
                  moe_router_score_function="softmax", moe_aux_loss_coeff=coeff,
                  moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
                  moe_token_dispatcher_type=moe_token_dispatcher_type, moe_enable_deepep=moe_enable_deepep,
                  moe_grouped_gemm=False,
                  expert_model_parallel_size=ep, moe_z_loss_coeff=moe_z_loss_coeff, moe_router_dtype=moe_router_dtype)
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif recompute is not None:
        raise ValueError(f"recompute={recompute!r}: use None, 'full' or 'selective'")
    kw.update(spec.extra.get("megatron", {}))
    kw.update(overrides)
    return (MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig)(**kw)
