"""Tiny random HF models shaped like real releases, one per supported family (no downloads).

Each keeps the release's rope (type, theta, scaling), norm, bias, tie, head_dim-vs-hidden/heads
relation and MoE routing settings, reduced in size.  Weights ~ N(0, 0.1) and norms ~ 1 + N(0, 0.1)
so logits are far from uniform and layout mistakes show.
"""
from __future__ import annotations

import torch

_COMMON = dict(vocab_size=1000, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=4096)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

FAMILY_MODELS = {
    # Llama-3.2-1B: tied, llama3 rope (factor 32), GQA, no bias
    "llama3": ("LlamaConfig", dict(intermediate_size=128, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                   rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=131072)),
    # Llama-3.x-like with non-standard llama3 parameters (megatron's built-in option cannot express them)
    "llama3_custom": ("LlamaConfig", dict(intermediate_size=128, tie_word_embeddings=False,
                                          rope_parameters=dict(LLAMA3_ROPE, factor=8.0, high_freq_factor=2.0,
                                                               original_max_position_embeddings=1024))),
    # Qwen2.5-0.5B: tied, q/k/v bias, theta 1e6
    "qwen2_5": ("Qwen2Config", dict(intermediate_size=96, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                    use_sliding_window=False)),
    # Qwen3-0.6B: tied, q/k norm, head_dim 32 != 64 / 4, no bias
    "qwen3": ("Qwen3Config", dict(intermediate_size=96, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                  attention_bias=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3-30B-A3B: untied, q/k norm, head_dim != hidden/heads, 8 of 128 experts -> 2 of 8, norm_topk_prob
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, head_dim=32,
                                         tie_word_embeddings=False, rms_norm_eps=1e-6, decoder_sparse_step=1,
                                         mlp_only_layers=[], router_aux_loss_coef=0.001,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Mixtral-8x7B: untied, 8 experts top-2, theta 1e6
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                      tie_word_embeddings=False, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # DeepSeek-V3 (671B) / Moonlight-16B-A3B: MLA (q LoRA, kv latent, rope 64 + nope 128 -> 8 + 16 here), YaRN
    # factor 40, first_k_dense_replace 3 -> 1, 256 routed experts top-8 in 8 groups (4 kept) -> 8 top-2 in 2 groups
    # (1 kept: top-k // topk_group = 2 as in the release), 1 shared expert, sigmoid + correction bias, scale 2.5
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_interleave=True,
        max_position_embeddings=163840,
        # keys of the release's config.json that transformers' class lacks and SGLang's DeepseekV2 model reads
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096})),
}


def build_family_model(kind: str, num_layers: int = 4, seed: int = 0, **overrides):
    """An in-memory random HF causal LM of `kind` (a key of FAMILY_MODELS), fp32, eval mode."""
    import transformers

    cls_name, kw = FAMILY_MODELS[kind]
    cfg = getattr(transformers, cls_name)(**{**_COMMON, **kw, "num_hidden_layers": num_layers, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: non-zero so its mapping shows
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def make_family_model(out_dir: str, kind: str, num_layers: int = 4, seed: int = 0, **overrides) -> str:
    """Write `build_family_model(kind, ...)` to `out_dir` (config + safetensors); returns `out_dir`."""
    build_family_model(kind, num_layers, seed, **overrides).save_pretrained(out_dir)
    return out_dir
