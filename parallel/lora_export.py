"""Export a LoRA actor's adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``, with one adapter per fused layer:
``delta W_qkv = s * B_qkv A``.  Its rows split like the base weight's (parallel.convert.layout), so PEFT's per-module
adapters are B_q, B_k, B_v (the row blocks of B_qkv, converted exactly as W_qkv is) sharing the one A:
``delta W_q = s * B_q A`` -- the same update, in PEFT's layout.  Row-parallel layers (o_proj, down_proj) map
one to one.  Routed experts (``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` for Qwen3-MoE,
``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2`` for Mixtral: the family converter's names) the same way, their
sharded tensor gathered over the expert-TP group; each EP rank exports its own experts.  The merged HF weights come
from parallel.convert.save_hf_checkpoint (its walk merges adapted weights, parallel.lora).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from parallel.convert.layout import hf_tensors_from_shards
from parallel.convert.params import param_role, unwrap_model
from parallel.lora import COLUMN, HF_TO_MEGATRON, LoRASettings, adapted_layers

__all__ = ["peft_adapter_tensors", "gather_peft_adapter", "peft_config", "save_peft_adapter", "PEFT_PREFIX"]

PEFT_PREFIX = "base_model.model."


def _gather(t: torch.Tensor, dim: int, group, size: int) -> list[torch.Tensor]:
    from parallel import devices

    if size == 1:
        return [t.detach()]
    t = devices.to_group_device(t.detach().contiguous(), group)
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


@torch.no_grad()
def peft_adapter_tensors(model_chunks, spec) -> dict[str, torch.Tensor]:
    """{PEFT key: full tensor (cpu)} of this PP stage's adapters: ``base_model.model.<hf module>.lora_A.weight``
    [r, in] and ``.lora_B.weight`` [out, r] (routed experts: this EP rank's experts only, see
    :func:`gather_peft_adapter`).  Collective over the TP group (one all-gather per sharded tensor; the expert-TP
    group for a routed expert's)."""
    from megatron.core import parallel_state as ps

    dense = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for chunk in model_chunks:
        chunk = unwrap_model(chunk)
        for path, adapter in adapted_layers(chunk).items():
            role = param_role(f"{path}.weight", chunk, spec)
            group, size = ((adapter.expert_groups[0], ps.get_expert_tensor_parallel_world_size())
                           if adapter.expert_groups is not None else dense)
            if adapter.kind == COLUMN:
                a_full = adapter.a.detach()
                bs = hf_tensors_from_shards(role, _gather(adapter.b, 0, group, size), spec)
                pairs = [(name, a_full, b) for name, b in bs]
            else:
                (name, a_full), = hf_tensors_from_shards(role, _gather(adapter.a, 1, group, size), spec)
                pairs = [(name, a_full, adapter.b.detach())]
            for name, a, b in pairs:
                module = PEFT_PREFIX + name.removesuffix(".weight")
                out[f"{module}.lora_A.weight"] = a.cpu().clone()
                out[f"{module}.lora_B.weight"] = b.cpu().clone().contiguous()
    return out


def _expert_keys(model_chunks, spec) -> set[str]:
    """The PEFT keys of this rank's routed-expert adapters (as :func:`peft_adapter_tensors` names them)."""
    keys = set()
    for chunk in model_chunks:
        chunk = unwrap_model(chunk)
        for path, adapter in adapted_layers(chunk).items():
            if adapter.expert_groups is not None:
                for name in param_role(f"{path}.weight", chunk, spec).hf_names:
                    module = PEFT_PREFIX + name.removesuffix(".weight")
                    keys |= {f"{module}.lora_A.weight", f"{module}.lora_B.weight"}
    return keys


def peft_target_modules(targets) -> list[str]:
    """The HF (PEFT) module names of megatron `targets` (linear_qkv -> q_proj, k_proj, v_proj, ...)."""
    return sorted(n for n, m in HF_TO_MEGATRON.items() if m in targets)


def peft_config(settings: LoRASettings, base_model: str | None = None, tensors=None) -> dict:
    """PEFT's ``adapter_config.json`` of the adapters `settings` describe (plain LoRA, no dropout, no bias).
    With `tensors` (the PEFT keys) ``target_modules`` are the module names they hold (Mixtral's experts: w1, w2,
    w3), else :func:`peft_target_modules`."""
    modules = (sorted({k.rsplit(".", 3)[1] for k in tensors}) if tensors
               else peft_target_modules(settings.targets))
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "base_model_name_or_path": base_model, "modules_to_save": None}


def gather_peft_adapter(model_chunks, spec, dtype: torch.dtype | None = None, group=None) -> dict[str, torch.Tensor]:
    """Collective over `group` (default: the whole job): every PP stage's adapters, ``{PEFT key: full CPU tensor}``
    sorted by key (:func:`peft_adapter_tensors`; `dtype` casts them), on every rank.  Data-parallel replicas hold
    the same adapters; only DP rank 0's travel (a routed expert's: expert-DP rank 0's of each EP rank)."""
    from megatron.core import parallel_state as ps

    local = peft_adapter_tensors(model_chunks, spec)
    if dtype is not None:
        local = {k: v.to(dtype) for k, v in local.items()}
    dense_lead = ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
    expert_lead = ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    experts = _expert_keys(model_chunks, spec) if local else set()
    local = {k: v for k, v in local.items() if (expert_lead if k in experts else dense_lead)}
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return dict(sorted((k, v) for p in parts for k, v in p.items()))


def save_peft_adapter(model_chunks, spec, settings: LoRASettings, out_dir: str, base_model: str | None = None,
                      dtype: torch.dtype | None = None) -> None:
    """Collective over the whole job: write `out_dir`/adapter_config.json and adapter_model.safetensors (global
    rank 0 writes, after gathering every PP stage's adapters), loadable with
    ``peft.PeftModel.from_pretrained(hf_model, out_dir)`` onto the base HF model.  `dtype` casts the tensors."""
    from safetensors.torch import save_file

    tensors = gather_peft_adapter(model_chunks, spec, dtype)
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, "adapter_model.safetensors.tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, "adapter_model.safetensors"))
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump(peft_config(settings, base_model, tensors), f, indent=2)
    dist.barrier()
