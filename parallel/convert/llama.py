"""Llama family: LlamaForCausalLM (Llama 2/3.x), Qwen2ForCausalLM (Qwen2, Qwen2.5), MistralForCausalLM.

RMSNorm, SwiGLU, GQA/MHA, RoPE; Qwen2 has q/k/v bias; tied or untied embeddings.  The maps
below are also the base of the other families (Qwen3 adds q/k norms, MoE families replace the
MLP).  Megatron names cover both the local spec (separate norms) and the Transformer Engine spec
(norms fused into the following linear layer as ``layer_norm_weight``).
"""
from __future__ import annotations

from parallel.convert.family import ModelFamily
from parallel.convert.spec import UnsupportedModelError

TOP_MAP = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),  # tied models: see params.param_role
}

ATTENTION_MAP = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv_bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                    "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
}

POST_ATTENTION_NORM_MAP = {
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
}

DENSE_MLP_MAP = {
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}

LAYER_MAP = {**ATTENTION_MAP, **POST_ATTENTION_NORM_MAP, **DENSE_MLP_MAP}


def spec_fields(hf_config, architecture: str) -> dict:
    """Qwen2 always has q/k/v bias; Llama/Mistral follow `attention_bias`.  MLP bias is refused."""
    if getattr(hf_config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported (Llama variants with MLP bias)")
    qkv_bias = architecture == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias", False))
    return {"qkv_bias": qkv_bias}


FAMILY = ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"),
    model_types={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"},
    top_map=TOP_MAP,
    layer_map=LAYER_MAP,
    spec_fields=spec_fields,
    features="RMSNorm, SwiGLU, GQA/MHA, RoPE (default, llama3), Qwen2 q/k/v bias, tied or untied embeddings",
)
