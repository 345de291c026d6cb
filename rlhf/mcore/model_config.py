"""Hugging Face config -> megatron-core TransformerConfig and GPTModel arguments.

Supported architectures are those of the converter registry (`rlhf.mcore.convert.registry`, one
family file each: features there).  Every check runs
before any weight is allocated, so a bad layout fails in milliseconds with a message naming the
offending value and the fix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.mcore.convert.registry import get_converter, resolve_architecture, supported_architectures
from rlhf.mcore.convert.spec import HFModelSpec, UnsupportedModelError

__all__ = ["HFModelSpec", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "hf_model_spec", "padded_vocab_size",
           "transformer_config_from_hf", "validate_parallel_layout"]

SUPPORTED_ARCHITECTURES = supported_architectures()
"""HF architecture names with a registered converter (`rlhf.mcore.convert.registry`)."""


def _rope_theta(hf_config) -> float:
    # transformers >= 5 keeps RoPE settings in `rope_parameters`; older configs use rope_theta.
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise UnsupportedModelError(
                f"rope_parameters.rope_type={rope_type!r} is not supported yet; only plain RoPE ('default')")
        return float(params["rope_theta"])
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise UnsupportedModelError(f"rope_scaling={scaling!r} is not supported yet; only plain RoPE")
    return float(getattr(hf_config, "rope_theta", 10000.0))


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
    family_fields = get_converter(arch).spec_fields(hf_config, arch)
    return HFModelSpec(
        architecture=arch, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads, num_query_groups=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps), rope_theta=_rope_theta(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), **family_fields)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: round vocab_size up to a multiple of divisible_by * tp."""
    multiple = make_vocab_size_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def validate_parallel_layout(spec: HFModelSpec, tp: int, pp: int, vpp: int | None = None,
                             num_layers_in_first_pipeline_stage: int | None = None,
                             num_layers_in_last_pipeline_stage: int | None = None) -> None:
    """Check that tp/pp(/vpp) can shard this model; raises ValueError naming the value and the fix.

    megatron-core only asserts some of these when building, and under `python -O` silently
    builds fewer layers, so we validate ourselves.
    """
    if spec.num_attention_heads % tp:
        raise ValueError(f"tensor parallel size tp={tp} does not divide num_attention_heads="
                         f"{spec.num_attention_heads}; choose tp from the divisors of both head counts")
    if spec.num_query_groups % tp:
        raise ValueError(f"tensor parallel size tp={tp} does not divide num_key_value_heads="
                         f"{spec.num_query_groups} (megatron shards whole query groups); use tp in "
                         f"{[d for d in range(1, spec.num_query_groups + 1) if spec.num_query_groups % d == 0]}")
    if spec.ffn_hidden_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={spec.ffn_hidden_size}")
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    middle_layers = spec.num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    chunks = middle_stages * (vpp or 1)
    if middle_layers < 0 or (middle_stages > 0 and middle_layers % chunks) or (middle_stages == 0 and middle_layers):
        raise ValueError(f"pipeline parallel size pp={pp}{f' x vpp={vpp}' if vpp else ''} does not divide "
                         f"num_hidden_layers={spec.num_layers}"
                         f"{f' (first stage {first}, last stage {last})' if first or last else ''}; "
                         f"choose pp dividing the layer count or set num_layers_in_first/last_pipeline_stage")


def transformer_config_from_hf(hf_config, tp: int = 1, pp: int = 1, vpp: int | None = None,
                               params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                               recompute: str | None = None, **overrides):
    """Build a megatron-core TransformerConfig matching the HF model numerics.

    Dropout is 0 (RLHF needs deterministic log-probs); bias_activation_fusion off (no bias).
    `overrides` are passed to TransformerConfig last (e.g. `num_layers_in_first_pipeline_stage`).
    Raises UnsupportedModelError / ValueError from hf_model_spec / validate_parallel_layout.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = hf_model_spec(hf_config)
    validate_parallel_layout(spec, tp, pp, vpp, overrides.get("num_layers_in_first_pipeline_stage"),
                             overrides.get("num_layers_in_last_pipeline_stage"))
    kw = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim, layernorm_epsilon=spec.rms_norm_eps, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, use_cpu_initialization=not torch.cuda.is_available(),
        persist_layer_norm=False, apply_rope_fusion=False, masked_softmax_fusion=torch.cuda.is_available(),
        gradient_accumulation_fusion=False,
        # batch_p2p_comm=True gives silently wrong results for interleaved PP=2 on gloo (the previous
        # and next peer are the same rank); unbatched p2p is exact everywhere.
        batch_p2p_comm=False,
    )
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif recompute is not None:
        raise ValueError(f"recompute={recompute!r}: use None, 'full' or 'selective'")
    kw.update(overrides)
    return TransformerConfig(**kw)
