"""SGLang's ``torch_native`` attention backend for DeepSeek-V3's multi-latent attention prefill (CPU engine).

Why: SGLang 0.5.23 has no DeepSeek attention handler for ``torch_native``, so ``DeepseekV2AttentionMLA`` takes
the triton handler's choice: a prefill without cached prefix runs the *MHA* form (``forward_normal``).  That form
writes the latent cache itself (``[kv_a; k_pe]``, one head of ``kv_lora_rank + qk_rope_head_dim``) and calls
``attn_mha(q, k, v, save_kv_cache=False)`` with the per-head keys and values it computed (``kv_b_proj``).
``TorchNativeAttnBackend.forward_extend`` ignores those and attends over the KV pool instead, i.e. over the
latent vectors: the prefill attends to the wrong keys/values (with the tiny test model's sizes, 16 + 8 = 24 =
16 + 8, the shapes even agree and nothing fails), so greedy tokens differ from transformers' from the first
token.  The absorbed MLA form (decode, and prefill after a prefix-cache hit) is right: the pool holds exactly
the latent keys/values that form attends over.

The fix, applied in every SGLang process that imports this stand-in (the scheduler included): an MHA extend over
an MLA pool with ``save_kv_cache=False`` attends over the given ``k`` / ``v``, causally per sequence -- what the
CUDA backends do (they run a ragged prefill over q/k/v).  The triton handler chooses the MHA form only without
a cached prefix; an extend with a prefix raises instead of computing something else.
"""
from __future__ import annotations

TARGET = "sglang.srt.layers.attention.torch_native_backend"


def mha_extend_from_inputs(q, k, v, layer, forward_batch):
    """Causal attention of each sequence's new tokens over themselves, from the given q/k/v.

    q, k: [T, heads * qk_head_dim]; v: [T, heads * v_head_dim] (T = the extend's tokens, sequences back to back,
    ``forward_batch.extend_seq_lens`` each); returns [T, heads * v_head_dim], softmax scale ``layer.scaling``.
    Raises NotImplementedError for an extend that continues a cached prefix (the keys of the prefix are only in
    the latent pool)."""
    import torch

    if int(forward_batch.extend_prefix_lens.sum()) != 0:
        raise NotImplementedError("sgl_kernel stand-in: an MHA-form MLA extend over a cached prefix on the "
                                  "torch_native backend (SGLang picks the absorbed form for those)")
    heads = layer.tp_q_head_num
    q_ = q.view(-1, heads, layer.qk_head_dim)
    k_ = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v_ = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
    out = q.new_empty((q_.shape[0], heads, layer.v_head_dim))
    start = 0
    for n in forward_batch.extend_seq_lens.tolist():
        rows = slice(start, start + n)
        out[rows] = torch.nn.functional.scaled_dot_product_attention(
            q_[rows].transpose(0, 1), k_[rows].transpose(0, 1), v_[rows].transpose(0, 1), is_causal=True,
            scale=layer.scaling, enable_gqa=heads != layer.tp_k_head_num).transpose(0, 1)
        start += n
    return out.view(q_.shape[0], heads * layer.v_head_dim)


def patch(module) -> None:
    """Wrap ``module.TorchNativeAttnBackend.forward_extend`` (see the module docstring); idempotent."""
    cls = module.TorchNativeAttnBackend
    if getattr(cls.forward_extend, "_rlhf_mla_prefill", False):
        return
    original = cls.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        if save_kv_cache or k is None or v is None or not isinstance(self.token_to_kv_pool, MLATokenToKVPool):
            return original(self, q, k, v, layer, forward_batch, save_kv_cache)
        return mha_extend_from_inputs(q, k, v, layer, forward_batch)

    forward_extend._rlhf_mla_prefill = True
    cls.forward_extend = forward_extend


def install() -> None:
    """Patch now when the backend module is already imported, else when it is."""
    from ._after_import import after_import

    after_import(TARGET, patch)
