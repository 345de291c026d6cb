"""Helpers of scripts/gpu_smoke_megatron.py: the smoke model sizes, batches, the memory measurement and the plan.

Kept apart from the checks so each file has one job; nothing here runs on import.
"""
from __future__ import annotations

import gc
import os

import torch

# name -> (HF Qwen2 config overrides, batch: sequences, tokens per sequence, response tokens, micro batch)
SIZES = {
    # CPU dry run: seconds per pass on 2 cores
    "tiny": (dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048), dict(batch=4, seq=64, response=24, micro=2)),
    # one GPU: ~0.2B parameters, activations and logits a third of the peak, well under a minute per phase
    "small": (dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000), dict(batch=8, seq=512, response=192, micro=4)),
}


def make_hf_model(path: str, size: str, seed: int = 0) -> dict:
    """A random Qwen2 (GQA, q/k/v bias, untied head) in bf16 safetensors at `path`; returns config.json's dict."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      use_sliding_window=False, **SIZES[size][0])
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return model.config.to_dict()


def rl_batch(size: str, vocab: int, seed: int = 0) -> dict:
    """Left-padded prompts + right-padded responses ([B, S] int64 on the CPU), with response_mask [B, R]."""
    b = SIZES[size][1]
    B, S, R = b["batch"], b["seq"], b["response"]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (B, S), generator=g)
    am = torch.ones_like(ids)
    for i in range(B):
        am[i, : (i * 7) % (S - R - 4)] = 0  # prompt padding on the left
        am[i, S - (i * 5) % (R - 2):] = 0 if i % 2 else 1  # response padding on the right
    ids = torch.where(am.bool(), ids, torch.zeros_like(ids))
    return dict(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0),
                response_mask=am[:, -R:].float())


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python objects (the CPU stand-in for
    `torch.cuda.memory_allocated`)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj) or obj.device.type != "cpu" or obj.is_meta:
                continue
            st = obj.untyped_storage()
        except Exception:  # noqa: BLE001  (objects that refuse introspection)
            continue
        if st.data_ptr() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def measure_peak(fn, device: str) -> tuple[int, object]:
    """(peak bytes allocated while `fn()` runs, fn's result).  CUDA: torch.cuda.max_memory_allocated after
    a reset; CPU: the live tensor bytes before plus the profiler's allocation peak during `fn`."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), out
    from torch.profiler import ProfilerActivity, profile

    base = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return base + peak, out


def smoke_plan(hf_dict: dict, size: str, use_te: bool, fused_adam: bool, fused_swiglu: bool, device: str):
    """The memory plan of what the smoke process holds: actor + critic (torch/TE Adam, not distributed)
    and reference, TP1 x PP1 x DP1, bf16, no recompute, no engine."""
    from rlhf.memory_plan.planner import GiB, Layout, PlanInput, Role, Workload, plan_memory
    from rlhf.memory_plan.terms import ModelShape

    b = SIZES[size][1]
    micro = b["micro"]
    roles = (Role("actor", micro_batch=micro, num_micro_batches=b["batch"] // micro, entropy=True),
             Role("critic", micro_batch=micro, num_micro_batches=b["batch"] // micro),
             Role("reference", trainable=False))
    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 64 * GiB
    return plan_memory(PlanInput(model=ModelShape.from_hf_config(hf_dict), layout=Layout(), roles=roles,
                                 workload=Workload(seq_length=b["seq"], log_prob_micro_batch=micro), gpu_bytes=total,
                                 params_bytes=2, recompute=None, flash_attention=use_te, fused_adam=fused_adam,
                                 fused_swiglu=fused_swiglu, cuda=device == "cuda"))


def optimizer_is_fused() -> bool:
    """Whether megatron-core's Adam is a fused multi-tensor kernel (TE or Apex) rather than torch's."""
    from megatron.core import optimizer as mo

    return getattr(mo, "Adam", torch.optim.AdamW).__module__.split(".")[0] in ("transformer_engine", "apex")


def set_single_process_env() -> None:
    """torch.distributed variables of a one-process job (kept when already set)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(port))):
        os.environ.setdefault(k, v)
