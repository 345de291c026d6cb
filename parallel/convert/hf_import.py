"""HF safetensors -> this rank's megatron shards (`load_hf_checkpoint`).

Every rank reads, with safetensors slices, only the rows and columns of its own TP shard of the
layers of its own PP (and VPP) stage, and only its own experts under expert parallelism: no rank
ever holds the full model.
"""
from __future__ import annotations

import torch

from parallel.convert.hf_io import HFCheckpointReader
from parallel.convert.layout import ParamRole, local_shard_from_hf
from parallel.convert.params import walk_local_tensors


def shard_rank_and_size(role: ParamRole) -> tuple[int, int]:
    """(rank, size) of the group a tensor of `role` is sharded over: the expert tensor-parallel
    group for routed experts, the tensor-parallel group otherwise (megatron parallel_state)."""
    from megatron.core import parallel_state as ps

    if role.is_expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


@torch.no_grad()
def load_hf_checkpoint(model_chunks, hf_path: str, spec) -> int:
    """Load a HF safetensors checkpoint into the local shards of `model_chunks` (list of GPTModel).

    Each rank reads only its own slices.  Tensors without a HF counterpart (value head) keep
    their initialisation; the tied last-stage `output_layer.weight` is filled from the embedding.
    Returns the number of local tensors loaded.  Raises KeyError naming a tensor missing from the
    checkpoint, ValueError on a shape mismatch (before that tensor is copied).
    """
    n = 0
    with HFCheckpointReader(hf_path) as reader:
        for t in walk_local_tensors(model_chunks, spec, include_tied_copy=True):
            rank, size = shard_rank_and_size(t.role)
            shard = local_shard_from_hf(reader, t.role, t.tensor, spec, rank, size)
            if shard.shape != t.tensor.shape:
                raise ValueError(f"{t.local_name}: shard from {t.role.hf_names} has shape {tuple(shard.shape)}, "
                                 f"megatron parameter has {tuple(t.tensor.shape)}")
            t.tensor.copy_(shard)
            n += 1
    return n
