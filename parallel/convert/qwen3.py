"""Qwen3 family: Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM (routed experts).

Qwen3 differs from the Llama family by per-head q/k RMSNorm (megatron's `q_layernorm` /
`k_layernorm`, applied before RoPE in both), no q/k/v bias and a `head_dim` that need not equal
hidden_size / num_attention_heads.  Qwen3-MoE replaces every MLP by a softmax top-k router
(``mlp.gate``) over routed experts (``mlp.experts.<e>.{gate,up,down}_proj``), no shared expert;
`norm_topk_prob` renormalises the top-k weights.
"""
from __future__ import annotations

from parallel.convert.family import ModelFamily
from parallel.convert.llama import ATTENTION_MAP, DENSE_MLP_MAP, POST_ATTENTION_NORM_MAP, TOP_MAP
from parallel.convert.spec import UnsupportedModelError

QK_NORM_MAP = {
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
}

MOE_MAP = {
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
    "mlp.experts.{expert}.linear_fc1.weight": ("expert_fc1", ("mlp.experts.{expert}.gate_proj.weight",
                                                              "mlp.experts.{expert}.up_proj.weight")),
    "mlp.experts.{expert}.linear_fc2.weight": ("expert_row", ("mlp.experts.{expert}.down_proj.weight",)),
}

LAYER_MAP = {**ATTENTION_MAP, **QK_NORM_MAP, **POST_ATTENTION_NORM_MAP, **DENSE_MLP_MAP, **MOE_MAP}


def moe_fields(hf_config, num_experts: int, moe_ffn_hidden_size: int, norm_topk_prob: bool) -> dict:
    """HFModelSpec MoE fields shared by the MoE families; refuses router jitter and shared experts."""
    if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise UnsupportedModelError(f"router_jitter_noise={hf_config.router_jitter_noise}: only 0 is supported")
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise UnsupportedModelError("shared experts are not supported (shared_expert_intermediate_size > 0)")
    return {"num_experts": int(num_experts), "moe_topk": int(hf_config.num_experts_per_tok),
            "moe_ffn_hidden_size": int(moe_ffn_hidden_size), "moe_norm_topk_prob": bool(norm_topk_prob),
            "moe_aux_loss_coef": float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)}


def spec_fields(hf_config, architecture: str) -> dict:
    """q/k norm, `attention_bias`; for Qwen3-MoE the routed-expert sizes (every layer sparse)."""
    fields = {"qkv_bias": bool(getattr(hf_config, "attention_bias", False)), "qk_norm": True}
    if architecture == "Qwen3MoeForCausalLM":
        if list(getattr(hf_config, "mlp_only_layers", None) or []) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError(
                f"Qwen3-MoE with dense layers (mlp_only_layers={hf_config.mlp_only_layers}, decoder_sparse_step="
                f"{hf_config.decoder_sparse_step}) is not supported; every layer must be sparse")
        num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
        fields.update(moe_fields(hf_config, num_experts, hf_config.moe_intermediate_size,
                                 getattr(hf_config, "norm_topk_prob", False)))
    return fields


FAMILY = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    model_types={"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"},
    top_map=TOP_MAP,
    layer_map=LAYER_MAP,
    spec_fields=spec_fields,
    features="q/k RMSNorm, head_dim != hidden/heads, no qkv bias; MoE: softmax top-k router, routed experts, EP",
)
