"""This rank's megatron shards -> full HF tensors (`iter_hf_tensors`) and a HF directory
(`save_hf_checkpoint`).

One tensor at a time, the (expert-)TP group all-gathers the shards into the full HF tensor
(padded vocab rows trimmed); routed experts are then all-gathered over the expert-parallel group
so every EP rank yields every expert of its stage.  Peak extra memory: one full tensor (times
the EP size for experts).
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
import torch.distributed as dist

from parallel import devices
from parallel.convert.layout import GATHER_DIM, hf_tensors_from_shards
from parallel.convert.params import param_role, walk_local_tensors


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    t = devices.to_group_device(t.contiguous(), group)
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


@torch.no_grad()
def iter_hf_tensors(model_chunks, spec, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every HF tensor whose megatron tensor lives on this PP
    stage.  Collective: all ranks of the stage's TP and EP groups must iterate together (one
    all-gather per tensor); every TP (and EP) rank receives the full tensors.  Order: the walk's
    order; experts of one local tensor in EP-rank order.  `dtype` casts the yielded tensors.
    """
    from megatron.core import parallel_state as ps

    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    for t in walk_local_tensors(model_chunks, spec):
        tensor, role = t.values(), t.role
        if role.is_expert:
            group, size = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
        else:
            group, size = tp_group, tp
        shards = [tensor] if GATHER_DIM[role.kind] is None else _all_gather(tensor, group, size)
        converted = hf_tensors_from_shards(role, shards, spec)
        if role.is_expert and ps.get_expert_model_parallel_world_size() > 1:
            ep, ep_group = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()
            per_rank = [_all_gather(full, ep_group, ep) for _, full in converted]
            for r in range(ep):
                names = param_role(t.local_name, t.chunk, spec, ep_rank=r).hf_names
                for name, gathered in zip(names, per_rank):
                    yield name, (gathered[r] if dtype is None else gathered[r].to(dtype)).contiguous()
            continue
        for hf_name, full in converted:
            yield hf_name, (full if dtype is None else full.to(dtype)).contiguous()


def save_hf_checkpoint(model_chunks, spec, hf_config, out_dir: str, tokenizer=None,
                       dtype: torch.dtype | None = None) -> None:
    """Write the model as a HF directory (config, safetensors, tokenizer) loadable with
    `AutoModelForCausalLM.from_pretrained(out_dir)`.

    Collective over the whole job. Each PP stage's (tp 0, dp 0) rank writes its own shard file;
    global rank 0 writes config, tokenizer and the index. Files appear atomically (tmp + rename).
    """
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    # one writer per pipeline stage: TP rank 0 of the first data-parallel x context-parallel replica
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    tensors = {}
    for name, t in iter_hf_tensors(model_chunks, spec, dtype):
        if writer:
            tensors[name] = t.cpu().clone()
    fname = "model.safetensors" if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    if writer:
        tmp = os.path.join(out_dir, fname + ".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, fname))
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, (fname, sorted(tensors)) if writer else None)
    if rank0:
        if pp > 1:
            weight_map = {n: f for entry in names if entry for f, ns in [entry] for n in ns}
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(out_dir, "model.safetensors.index.json.tmp"), "w") as f:
                json.dump(index, f, indent=2)
            os.replace(os.path.join(out_dir, "model.safetensors.index.json.tmp"),
                       os.path.join(out_dir, "model.safetensors.index.json"))
        cfg = hf_config.__class__.from_dict(hf_config.to_dict())
        if dtype is not None:
            cfg.torch_dtype = dtype
        cfg.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    dist.barrier()
