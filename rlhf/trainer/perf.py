"""verl's model-FLOPs utilisation and peak-memory metrics of a PPO step (verl/utils/flops_counter.py,
verl/workers/megatron_workers.py update_actor / update_critic):

    perf/mfu/actor      FLOPs of the actor update / (update seconds x peak FLOP/s of a device x trainer devices)
    perf/mfu/critic     the same for the critic update
    perf/max_memory_allocated_gb   peak memory of the trainer process so far, GiB: torch.cuda.max_memory_allocated
                                   on a CUDA device; on CPU the process's peak resident set (getrusage ru_maxrss)
    perf/max_memory_reserved_gb    (CUDA only) torch.cuda.max_memory_reserved, GiB

FLOPs of an update (verl's estimate, forward + backward = 6 FLOPs per parameter and token): 6 x (matmul
parameters of a token's path: attention projections, MLP or the routed top-k experts + shared experts + router,
embedding + LM head) x tokens, plus attention over the full square as verl counts it, 6 x sum(seq_len^2) x head_dim
x heads x layers (MLA: 3 x sum(seq_len^2) x (q_head_dim + v_head_dim) x heads x layers, verl's causal halving),
x ppo_epochs.  Tokens are every prompt + response token of the batch (``attention_mask``), as verl's
``global_token_num``.  Shared experts are counted as in verl's DeepSeek-V3 estimate (its Qwen2-MoE estimate leaves
them out).

Peak FLOP/s per device: verl's table (dense BF16, by device name: H100 989 TFLOP/s, A100 312, ...).  On CPU verl
declares 448 GFLOP/s, a nominal figure and not this machine's, used here the same way so a CPU run's MFU compares
with verl's CPU numbers only.  A device not in the table (an unknown GPU) has no known peak: perf/mfu/* is left
out and one line says so (verl would report 0).
"""
from __future__ import annotations

import logging
import re
import resource
import sys

import torch

__all__ = ["DEVICE_PEAK_FLOPS", "device_peak_flops", "update_flops", "PerfMeter"]

logger = logging.getLogger(__name__)

_GB = float(1 << 30)
#: peak dense BF16 FLOP/s by device name (verl/utils/flops_counter.py _DEVICE_FLOPS); matched as a substring of
#: torch.cuda.get_device_name, longest name first ("L40S" before "L40"); "CPU" is verl's declared CPU figure
DEVICE_PEAK_FLOPS = {"CPU": 448e9, "GB200": 2.5e15, "B200": 2.25e15, "MI300X": 1336e12, "H100": 989e12,
                     "H800": 989e12, "H200": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362.05e12,
                     "L40": 181.05e12, "A40": 149.7e12, "L20": 119.5e12, "H20": 148e12, "910B": 354e12,
                     "Ascend910": 354e12, "RTX 3070 Ti": 21.75e12}


def device_peak_flops(device: torch.device, name: str | None = None) -> float | None:
    """Peak FLOP/s of one `device` from :data:`DEVICE_PEAK_FLOPS`: "CPU" for a CPU device; for a CUDA device the
    entry whose name is in the device's name, not followed by a digit (`name`, default torch.cuda.get_device_name(device)); None when none
    matches or for another kind of device."""
    device = torch.device(device)
    if device.type == "cpu":
        return DEVICE_PEAK_FLOPS["CPU"]
    if device.type != "cuda":
        return None
    name = name if name is not None else torch.cuda.get_device_name(device)
    for key in sorted(DEVICE_PEAK_FLOPS, key=len, reverse=True):  # not followed by a digit: "A40" is not "A4000"
        if key != "CPU" and re.search(re.escape(key) + r"(?!\d)", name):
            return DEVICE_PEAK_FLOPS[key]
    return None


def update_flops(spec, seq_lens) -> float:
    """FLOPs of one forward + backward pass of a model (`spec`: parallel.convert.spec.HFModelSpec) over sequences
    of `seq_lens` tokens (verl's estimate, module docstring; its _estimate_qwen2_flops for dense models,
    _estimate_qwen2_moe_flops / _estimate_deepseek_v3_flops for MoE and MLA)."""
    H, L, heads = spec.hidden_size, spec.num_layers, spec.num_attention_heads
    tokens = float(sum(seq_lens))
    sq = float(sum(s * s for s in seq_lens))
    mega = spec.extra.get("megatron", {}) if spec.extra else {}
    if spec.multi_latent_attention:
        qk, rope, v = mega["qk_head_dim"], mega["qk_pos_emb_head_dim"], mega["v_head_dim"]
        q_head, q_lora, kv_lora = qk + rope, mega.get("q_lora_rank"), mega["kv_lora_rank"]
        attn = H * heads * q_head if not q_lora else H * q_lora + heads * q_head * q_lora
        attn += H * (kv_lora + rope) + heads * (q_head - rope + v) * kv_lora + heads * v * H
        attn_core = 3 * sq * (q_head + v) * heads * L
    else:
        d, kv = spec.head_dim, spec.num_query_groups
        attn = H * (heads * d + 2 * kv * d + heads * d)
        attn_core = 6 * sq * d * heads * L
    dense_mlp = 3 * H * spec.ffn_hidden_size
    if spec.is_moe:  # routed top-k experts + shared experts + the router; leading dense layers keep their MLP
        moe_mlp = 3 * H * (spec.moe_topk * spec.moe_ffn_hidden_size + spec.moe_shared_ffn_hidden_size) \
            + H * spec.num_experts
        dense_layers = spec.moe_dense_layers
        params = (moe_mlp + attn) * (L - dense_layers) + (dense_mlp + attn) * dense_layers
    else:
        params = (dense_mlp + attn) * L
    params += 2 * spec.vocab_size * H  # embedding + LM head, counted as verl does (also for a value head)
    return 6 * params * tokens + attn_core


class PerfMeter:
    """The perf/* metrics of the steps of one trainer (module docstring): `specs` role -> HFModelSpec of the roles
    that train ("actor", "critic"), `device` the trainer's compute device, `world_size` trainer devices, `epochs`
    role -> ppo_epochs.  `peak_flops` overrides the table (FLOP/s of one device)."""

    def __init__(self, specs: dict, device, world_size: int, epochs: dict, peak_flops: float | None = None):
        self.specs, self.epochs, self.world_size = specs, epochs, world_size
        self.device = torch.device(device)
        self.peak = peak_flops if peak_flops is not None else device_peak_flops(self.device)
        self.max_allocated = self.max_reserved = 0.0
        self._said = False

    def mfu(self, metrics: dict, batch: dict) -> dict:
        """``perf/mfu/<role>`` for each role whose ``timing_s/update_<role>`` is in `metrics` (the step's timers):
        update FLOPs x ppo_epochs / (seconds x peak x world_size), tokens from ``batch["attention_mask"]`` [N, S]."""
        if self.peak is None:
            if not self._said:
                logger.warning("perf/mfu/* not logged: the peak FLOP/s of %s is not known (rlhf.trainer.perf."
                               "DEVICE_PEAK_FLOPS lists the known devices)", self.device)
                self._said = True
            return {}
        lens = batch["attention_mask"].sum(1).tolist()
        out = {}
        for role, spec in self.specs.items():
            seconds = metrics.get(f"timing_s/update_{role}")
            if seconds:
                flops = update_flops(spec, lens) * self.epochs.get(role, 1)
                out[f"perf/mfu/{role}"] = flops / (seconds * self.peak * self.world_size)
        return out

    def memory(self, metrics: dict) -> dict:
        """``perf/max_memory_allocated_gb`` (and on CUDA ``perf/max_memory_reserved_gb``): the trainer process's
        peak so far.  CUDA: the largest of the phases' ``memory/<phase>/max_*_gb`` in `metrics` (each phase
        resets the peak, rlhf.trainer.metrics.timer), the current torch.cuda.max_memory_* and the earlier steps'.
        CPU: the peak resident set of this process (getrusage ru_maxrss; KiB on Linux, bytes on macOS).  Another
        kind of device: nothing."""
        if self.device.type == "cpu":
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return {"perf/max_memory_allocated_gb": rss * (1 if sys.platform == "darwin" else 1024) / _GB}
        if self.device.type != "cuda":
            return {}
        phases_alloc = [v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("max_allocated_gb")]
        phases_res = [v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("max_reserved_gb")]
        self.max_allocated = max([self.max_allocated, torch.cuda.max_memory_allocated(self.device) / _GB]
                                 + phases_alloc)
        self.max_reserved = max([self.max_reserved, torch.cuda.max_memory_reserved(self.device) / _GB] + phases_res)
        return {"perf/max_memory_allocated_gb": self.max_allocated, "perf/max_memory_reserved_gb": self.max_reserved}
