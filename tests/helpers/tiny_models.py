"""Tiny random Hugging Face causal LMs built locally (no downloads) for tests and demos."""
from __future__ import annotations

import os

import torch

# name -> (config class name, kwargs)
TINY_CONFIGS = {
    # Llama with grouped-query attention (4 q heads, 2 kv heads), untied, vocab not a multiple of 64
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    # Llama with multi-head attention
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    # Qwen2: q/k/v bias, tied embeddings, GQA
    "qwen2_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # square MLP (intermediate == hidden), rope theta not the default
    "llama_square": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                         rope_theta=500000.0, tie_word_embeddings=False)),
}


def make_tiny_hf_model(out_dir: str, kind: str = "llama_gqa", vocab_size: int = 1000, hidden_size: int = 64,
                       num_layers: int = 4, seed: int = 0, tokenizer=None, dtype=torch.float32, **overrides) -> str:
    """Write a random tiny HF model of `kind` (see TINY_CONFIGS) to `out_dir`; returns out_dir.

    Weights are random with std 0.1 so logits are far from uniform and layout mistakes show.
    """
    import transformers

    cls_name, kw = TINY_CONFIGS[kind]
    kw = dict(kw)
    rope_theta = kw.pop("rope_theta", None)
    kw.setdefault("intermediate_size", 2 * hidden_size)
    kw.update(overrides)
    cfg = getattr(transformers, cls_name)(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, rms_norm_eps=1e-6, **kw)
    if rope_theta is not None:
        if getattr(cfg, "rope_parameters", None) is not None:
            cfg.rope_parameters["rope_theta"] = rope_theta
        else:
            cfg.rope_theta = rope_theta
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
