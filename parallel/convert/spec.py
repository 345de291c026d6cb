"""The facts of a Hugging Face decoder config that the megatron side and the converters need.

`HFModelSpec` is filled by `parallel.model_config.hf_model_spec` (generic fields) and by the
model family's `spec_fields` hook (bias, q/k norm, MoE).  It lives here, below both
`model_config` and the converter registry, so that neither imports the other in a cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class UnsupportedModelError(ValueError):
    """The Hugging Face model cannot be mapped onto our megatron-core GPTModel."""


@dataclass
class HFModelSpec:
    """The facts of a HF decoder config the trainer, the converters and the weight bridge need.

    Sizes are element counts; `head_dim` may differ from hidden_size / num_attention_heads
    (Qwen3).  `rope_scaling` is None for plain RoPE, else the HF rope parameters dict (with its
    `rope_type`).  MoE fields are 0 for dense models: `num_experts` routed experts per layer,
    `moe_topk` experts per token, `moe_ffn_hidden_size` each expert's intermediate size,
    `moe_norm_topk_prob` whether the top-k routing weights are renormalised to sum to 1,
    `moe_aux_loss_coef` the HF config's router load-balancing coefficient (informational; the
    trainer takes its own from config), `moe_shared_ffn_hidden_size` the shared experts' fused
    intermediate size (0: none), `moe_dense_layers` how many leading layers are dense MLPs.
    `extra["megatron"]`: TransformerConfig fields a family sets itself (DeepSeek-V3: MLA, router).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    rope_scaling: dict | None = None
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_aux_loss_coef: float = 0.0
    moe_shared_ffn_hidden_size: int = 0
    moe_dense_layers: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def multi_latent_attention(self) -> bool:
        """True for MLA models (DeepSeek-V3): megatron's MLASelfAttention with its own RoPE."""
        return bool(self.extra.get("megatron", {}).get("multi_latent_attention"))
