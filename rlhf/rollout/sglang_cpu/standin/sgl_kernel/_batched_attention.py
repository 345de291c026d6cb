"""One batched attention call per decode / extend step on SGLang's ``torch_native`` backend (CPU engine).

Why: SGLang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_decode`` loops over the requests of a decode
batch in Python (its own TODO says so): per request and layer an index lookup, two KV gathers, two ``movedim``
and one ``scaled_dot_product_attention`` on one query token.  On the CPU engine this loop was the largest part
of a rollout: py-spy on the scheduler during grpo_tiny_cpu rounds (64 requests, 16 new tokens) put 44% of its
forward samples in that function (9% more in the extend loop, 22% in the linear layers).  The CPU backend that
batches (``intel_amx``) needs the real sgl_kernel build, which this machine does not have.

The replacement computes the same attention for the whole batch at once: each request's KV-cache rows
``req_to_token[req, :seq_len]`` padded to the batch's longest sequence (padding slots point at the request's
first token, so every gathered value is a written, finite one), a boolean mask hiding the padding, and one
``scaled_dot_product_attention`` over [batch, heads, 1, max_len].  The masked positions get probability exactly
0, so each request attends over exactly its own tokens, as in the loop; only the summation order of the
floating-point reductions may differ (same as a different SDPA kernel would).

The extend (prefill) step is batched the same way: each request's new tokens padded to the longest extend,
its cached prefix and new tokens as keys, the mask ``key < seq_len and key <= prefix_len + query`` (SGLang's
loop runs a causal attention over the whole sequence and keeps the new tokens' rows: the same mask).

Taken only for the plain case (causal self-attention, no encoder, no sliding window); anything else keeps
SGLang's loop.  GPU engines never import this stand-in.
"""
from __future__ import annotations

import torch

TARGET = "sglang.srt.layers.attention.torch_native_backend"


def batched_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling=None,
                   enable_gqa=False):
    """Decode attention of one query token per request over its cached keys/values, all requests at once.

    Args:
        query: [B, Hq, D] (B requests, one new token each); output: [B, Hq, Dv], written in place.
        k_cache / v_cache: [pool_tokens, Hkv, D] / [pool_tokens, Hkv, Dv] (SGLang's KV pool of one layer).
        req_to_token: [max_reqs, max_context] pool slot of each token of each request slot.
        req_pool_indices: [B] each request's row of ``req_to_token``; seq_lens: [B] tokens cached per request
            (the new one included), each >= 1.
        scaling: softmax scale (None: 1/sqrt(D)); enable_gqa: Hq is a multiple of Hkv.
    Returns:
        ``output``.
    """
    lens = seq_lens.to(torch.long)
    key, value, valid = _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, lens, int(lens.max()))
    if not (query.dtype == key.dtype == value.dtype):
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2), key, value, attn_mask=valid[:, None, None, :], scale=scaling, enable_gqa=enable_gqa)
    output.copy_(out.squeeze(2))
    return output


def _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, lens, max_len):
    """Keys / values [B, H, max_len, D] of each request's first ``lens`` cached tokens (padding slots repeat the
    request's first token) and the [B, max_len] mask of the real ones."""
    rows = req_to_token[req_pool_indices.to(torch.long), :max_len].to(torch.long)  # [B, L]
    valid = torch.arange(max_len, device=rows.device).unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
    rows = torch.where(valid, rows, rows[:, :1])
    return k_cache[rows].transpose(1, 2), v_cache[rows].transpose(1, 2), valid


def batched_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                   extend_seq_lens, scaling=None, enable_gqa=False):
    """Causal attention of each request's new tokens over its cached prefix and themselves, all requests at once.

    Args:
        query: [T, Hq, D], the requests' new tokens back to back (``extend_seq_lens`` each, T in all);
        output: [T, Hq, Dv], written in place.
        k_cache / v_cache, req_to_token, req_pool_indices: as in :func:`batched_decode` (the new tokens' keys and
            values are in the cache already).
        seq_lens: [B] prefix + new tokens; extend_prefix_lens / extend_seq_lens: [B] cached prefix / new tokens.
    Returns:
        ``output``.
    """
    lens = seq_lens.to(torch.long)
    prefix = extend_prefix_lens.to(torch.long)
    new = extend_seq_lens.to(torch.long)
    max_len, max_new = int(lens.max()), int(new.max())
    key, value, valid_kv = _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, lens, max_len)
    steps = torch.arange(max_new, device=lens.device)
    valid_q = steps.unsqueeze(0) < new.unsqueeze(1)  # [B, Lq]
    padded = query.new_zeros((lens.shape[0], max_new) + tuple(query.shape[1:]))
    padded[valid_q] = query  # row-major: request by request, tokens in order, as in `query`
    # key j is visible to new token i of request b when j < seq_len[b] and j <= prefix[b] + i
    visible = (torch.arange(max_len, device=lens.device).view(1, 1, -1)
               <= (prefix.view(-1, 1) + steps.view(1, -1)).unsqueeze(2)) & valid_kv.unsqueeze(1)  # [B, Lq, L]
    if not (query.dtype == key.dtype == value.dtype):
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded.transpose(1, 2), key, value, attn_mask=visible.unsqueeze(1), scale=scaling, enable_gqa=enable_gqa)
    output.copy_(out.transpose(1, 2)[valid_q])
    return output


def _plain(encoder_lens, is_cross_attn, sliding_window_size, seq_lens) -> bool:
    """Self-attention without encoder or sliding window over a non-empty batch: the case batched here."""
    return (encoder_lens is None and not is_cross_attn and (sliding_window_size is None or sliding_window_size <= -1)
            and seq_lens.numel() > 0)


def patch(module) -> None:
    """Route the plain case of ``module.TorchNativeAttnBackend._run_sdpa_forward_decode`` / ``_extend`` to
    :func:`batched_decode` / :func:`batched_extend`; idempotent."""
    cls = module.TorchNativeAttnBackend
    if getattr(cls._run_sdpa_forward_decode, "_rlhf_batched", False):
        return
    original = cls._run_sdpa_forward_decode

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                                 is_cross_attn=False, sliding_window_size=None):
        plain = not causal and _plain(encoder_lens, is_cross_attn, sliding_window_size, seq_lens)
        if not plain:
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                            is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
        return batched_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                              scaling=scaling, enable_gqa=enable_gqa)

    _run_sdpa_forward_decode._rlhf_batched = True
    cls._run_sdpa_forward_decode = _run_sdpa_forward_decode
    original_extend = cls._run_sdpa_forward_extend

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        plain = causal and _plain(encoder_lens, is_cross_attn, sliding_window_size, seq_lens)
        if not plain:
            return original_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                   seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling,
                                   enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                                   sliding_window_size=sliding_window_size)
        return batched_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                              extend_prefix_lens, extend_seq_lens, scaling=scaling, enable_gqa=enable_gqa)

    cls._run_sdpa_forward_extend = _run_sdpa_forward_extend


def install() -> None:
    """Patch now when the backend module is already imported, else when it is."""
    from ._after_import import after_import

    after_import(TARGET, patch)
