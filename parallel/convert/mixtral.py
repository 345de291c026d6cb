"""Mixtral family: MixtralForCausalLM (sparse MoE: softmax top-k router, renormalised weights).

Llama attention; every MLP is ``block_sparse_moe`` with a router ``gate`` and experts whose
``w1`` / ``w3`` / ``w2`` are gate / up / down.
"""
from __future__ import annotations

from parallel.convert.family import ModelFamily
from parallel.convert.llama import ATTENTION_MAP, POST_ATTENTION_NORM_MAP, TOP_MAP
from parallel.convert.qwen3 import moe_fields

MOE_MAP = {
    "mlp.router.weight": ("replicated", ("block_sparse_moe.gate.weight",)),
    "mlp.experts.{expert}.linear_fc1.weight": ("expert_fc1", ("block_sparse_moe.experts.{expert}.w1.weight",
                                                              "block_sparse_moe.experts.{expert}.w3.weight")),
    "mlp.experts.{expert}.linear_fc2.weight": ("expert_row", ("block_sparse_moe.experts.{expert}.w2.weight",)),
}

LAYER_MAP = {**ATTENTION_MAP, **POST_ATTENTION_NORM_MAP, **MOE_MAP}


def spec_fields(hf_config, architecture: str) -> dict:
    """Mixtral: no attention bias; experts sized by `intermediate_size`, top-k weights renormalised."""
    return {"qkv_bias": False, **moe_fields(hf_config, hf_config.num_local_experts, hf_config.intermediate_size,
                                            norm_topk_prob=True)}


FAMILY = ModelFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types={"mixtral": "MixtralForCausalLM"},
    top_map=TOP_MAP,
    layer_map=LAYER_MAP,
    spec_fields=spec_fields,
    features="Llama attention, softmax top-k router with renormalised weights, routed experts, EP",
)
