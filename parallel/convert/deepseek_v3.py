"""DeepSeek-V3 family: DeepseekV3ForCausalLM (DeepSeek-V3 / V3.1 / R1, Moonlight-16B-A3B).

Multi-latent attention (MLA) onto megatron-core's `MLASelfAttention`, routed + shared experts
onto its `MoELayer` with a sigmoid router:

* attention: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one ``q_proj`` when
  ``q_lora_rank`` is None), ``kv_a_proj_with_mqa`` (the kv latent, then the shared rope key),
  ``kv_a_layernorm``, ``kv_b_proj`` (per head: k_nope, then v), ``o_proj``.  Megatron's
  ``linear_q_down_proj`` / ``linear_kv_down_proj`` are column-parallel on the local spec (and made
  so on the TE spec, `parallel.models.layer_spec`), so every projection is a plain row split
  (``column``) except ``o_proj`` (``row``).  The HF rope is interleaved (``rope_interleave``);
  megatron's MLA RoPE de-interleaves the same way.  YaRN maps onto megatron's MLA YaRN options
  (`megatron_rope`).
* MLP: the first ``first_k_dense_replace`` layers are dense SwiGLU MLPs (``moe_layer_freq``);
  the others have a sigmoid router over ``n_routed_experts`` with the expert-score correction
  bias (``mlp.gate.e_score_correction_bias`` <-> megatron's ``expert_bias``, kept fixed:
  ``moe_router_bias_update_rate=0``), group-limited top-k (``n_group`` / ``topk_group``), the
  weights renormalised and scaled by ``routed_scaling_factor``, plus ``n_shared_experts`` shared
  experts fused into one MLP of ``n_shared_experts * moe_intermediate_size``.
"""
from __future__ import annotations

from parallel.convert.family import ModelFamily
from parallel.convert.llama import DENSE_MLP_MAP, POST_ATTENTION_NORM_MAP, TOP_MAP
from parallel.convert.spec import UnsupportedModelError

ATTENTION_MAP = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_q_proj.weight": ("column", ("self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": ("column", ("self_attn.q_a_proj.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.layer_norm_weight": ("replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.weight": ("column", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": ("column", ("self_attn.kv_a_proj_with_mqa.weight",)),
    "self_attention.kv_layernorm.weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.layer_norm_weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("column", ("self_attn.kv_b_proj.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
}

MOE_MAP = {
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
    "mlp.router.expert_bias": ("replicated", ("mlp.gate.e_score_correction_bias",)),
    "mlp.experts.{expert}.linear_fc1.weight": ("expert_fc1", ("mlp.experts.{expert}.gate_proj.weight",
                                                              "mlp.experts.{expert}.up_proj.weight")),
    "mlp.experts.{expert}.linear_fc2.weight": ("expert_row", ("mlp.experts.{expert}.down_proj.weight",)),
    "mlp.shared_experts.linear_fc1.weight": ("shared_fc1", ("mlp.shared_experts.gate_proj.weight",
                                                            "mlp.shared_experts.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_experts.down_proj.weight",)),
}

LAYER_MAP = {**ATTENTION_MAP, **POST_ATTENTION_NORM_MAP, **DENSE_MLP_MAP, **MOE_MAP}

LATENT_NORM_EPS = 1e-6
"""HF's (and DeepSeek's reference code's) `q_a_layernorm` / `kv_a_layernorm` use the RMSNorm
default eps 1e-6 whatever `rms_norm_eps` says; `parallel.models` builds them with this eps."""


def _rope(hf_config) -> dict:
    """HF rope parameters (transformers >= 5 `rope_parameters`, or legacy `rope_scaling`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", float(getattr(hf_config, "rope_theta", 10000.0)))
    return params


def megatron_rope(hf_config) -> dict:
    """MLATransformerConfig RoPE fields for the HF rope parameters: ``default`` -> megatron's
    ``rope``; ``yarn`` -> megatron's MLA YaRN (factor, original context, beta_fast/slow, mscale,
    mscale_all_dim), chosen so that the cos/sin concentration factor and the softmax scale
    (``mscale(factor, mscale_all_dim)**2 / sqrt(q_head_dim)``) equal transformers'.
    Raises UnsupportedModelError for other types, an explicit ``attention_factor`` or
    ``truncate=False`` (megatron always rounds the correction range)."""
    p = _rope(hf_config)
    rope_type = p.get("rope_type", p.get("type")) or "default"
    base = float(p["rope_theta"])
    if rope_type == "default":
        return {"rope_type": "rope", "rotary_base": base, "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
    if rope_type != "yarn":
        raise UnsupportedModelError(f"DeepSeek-V3 with rope_type={rope_type!r}: only 'default' and 'yarn' are "
                                    f"supported (megatron-core MLA's own rotary embeddings)")
    if p.get("attention_factor") is not None:
        raise UnsupportedModelError(f"yarn attention_factor={p['attention_factor']} given explicitly: megatron-core "
                                    f"derives it from mscale / mscale_all_dim; remove it from rope_parameters")
    if p.get("truncate", True) is False:
        raise UnsupportedModelError("yarn truncate=False: megatron-core always rounds the YaRN correction range")
    factor = p.get("factor") or hf_config.max_position_embeddings / p["original_max_position_embeddings"]
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    return {"rope_type": "yarn", "rotary_base": base, "rotary_scaling_factor": float(factor),
            "original_max_position_embeddings": int(p["original_max_position_embeddings"]),
            "beta_fast": float(p.get("beta_fast") or 32.0), "beta_slow": float(p.get("beta_slow") or 1.0),
            # transformers: concentration = m(f, mscale) / m(f, mscale_all_dim) when both are set, else m(f, 1);
            # megatron gives m(f, 1) for mscale=None
            "mscale": float(mscale) if mscale and mscale_all_dim else None,
            "mscale_all_dim": float(mscale_all_dim or 0.0)}


def _check_routing(c) -> None:
    if getattr(c, "scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"scoring_func={c.scoring_func!r}: DeepSeek-V3 routing is 'sigmoid'")
    if getattr(c, "topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError(f"topk_method={c.topk_method!r}: only 'noaux_tc' (sigmoid + correction bias)")
    if not getattr(c, "norm_topk_prob", True) and c.num_experts_per_tok > 1:
        raise UnsupportedModelError("norm_topk_prob=False: megatron-core's sigmoid router always renormalises "
                                    "the top-k weights; only norm_topk_prob=True is supported")
    groups, topk_group = int(c.n_group or 1), int(c.topk_group or 1)
    if c.n_routed_experts % groups:
        raise UnsupportedModelError(f"n_group={groups} does not divide n_routed_experts={c.n_routed_experts}")
    if groups > 1 and c.num_experts_per_tok // topk_group != 2:
        raise UnsupportedModelError(
            f"num_experts_per_tok={c.num_experts_per_tok} // topk_group={topk_group} != 2: transformers scores a "
            f"group by its top-2 experts, megatron-core by its top-(topk // group_topk); they agree only at 2")
    if int(getattr(c, "moe_layer_freq", 1) or 1) != 1:
        raise UnsupportedModelError(f"moe_layer_freq={c.moe_layer_freq}: only every layer after "
                                    f"first_k_dense_replace sparse (1) is supported")


def spec_fields(hf_config, architecture: str) -> dict:
    """MoE sizes, the shared expert size and `extra["megatron"]`: the MLA, RoPE and router fields
    of megatron-core's MLATransformerConfig for this config.  Raises UnsupportedModelError for
    an FP8-quantised checkpoint, attention bias, non-interleaved rope or routing megatron cannot
    reproduce (`_check_routing`)."""
    c = hf_config
    quant = getattr(c, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise UnsupportedModelError(f"quantized checkpoint (quantization_config quant_method={method!r}): "
                                    f"dequantize it to bf16 first (DeepSeek's fp8_cast_bf16.py)")
    if getattr(c, "attention_bias", False):
        raise UnsupportedModelError("attention_bias=True is not supported for DeepSeek-V3 MLA")
    if not getattr(c, "rope_interleave", True):
        raise UnsupportedModelError("rope_interleave=False: megatron-core's MLA always de-interleaves the rope "
                                    "dims (the released checkpoints' layout); set rope_interleave=True")
    _check_routing(c)
    layers, dense = int(c.num_hidden_layers), int(c.first_k_dense_replace or 0)
    if dense >= layers:
        raise UnsupportedModelError(f"first_k_dense_replace={dense} >= num_hidden_layers={layers}: no MoE layer")
    shared = int(c.n_shared_experts or 0) * int(c.moe_intermediate_size)
    megatron = {
        "multi_latent_attention": True, "q_lora_rank": c.q_lora_rank, "kv_lora_rank": int(c.kv_lora_rank),
        "qk_head_dim": int(c.qk_nope_head_dim), "qk_pos_emb_head_dim": int(c.qk_rope_head_dim),
        "v_head_dim": int(c.v_head_dim), "moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0,
        "moe_router_topk_scaling_factor": float(c.routed_scaling_factor),
        "moe_router_num_groups": int(c.n_group) if (c.n_group or 1) > 1 else None,
        "moe_router_group_topk": int(c.topk_group) if (c.n_group or 1) > 1 else None,
        "moe_router_dtype": "fp32", "moe_shared_expert_intermediate_size": shared or None,
        "moe_layer_freq": [0] * dense + [1] * (layers - dense), **megatron_rope(c)}
    return {"qkv_bias": False, "num_experts": int(c.n_routed_experts), "moe_topk": int(c.num_experts_per_tok),
            "moe_ffn_hidden_size": int(c.moe_intermediate_size), "moe_norm_topk_prob": True,
            "moe_shared_ffn_hidden_size": shared, "moe_dense_layers": dense,
            "moe_aux_loss_coef": float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0),
            "extra": {"megatron": megatron}}


FAMILY = ModelFamily(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types={"deepseek_v3": "DeepseekV3ForCausalLM"},
    top_map=TOP_MAP,
    layer_map=LAYER_MAP,
    spec_fields=spec_fields,
    features="multi-latent attention (q/kv LoRA, rope + nope heads), YaRN; first-k dense layers, sigmoid router "
             "with correction bias, group-limited top-k, shared experts, EP (megatron-core MLA + MoE)",
    extra={"rope_types": ("default", "yarn")},
)
