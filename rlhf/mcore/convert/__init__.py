"""Hugging Face <-> megatron-core weight conversion (import of local shards, export, per-tensor rules)."""
from rlhf.mcore.convert.hf_conversion import (GATHER_DIM, HFCheckpointReader, ParamRole, hf_tensors_from_shards,
                                              iter_hf_tensors, iter_local_params, load_hf_checkpoint,
                                              local_shard_from_hf, param_role, save_hf_checkpoint, unwrap_model)

__all__ = ["GATHER_DIM", "HFCheckpointReader", "ParamRole", "hf_tensors_from_shards", "iter_hf_tensors",
           "iter_local_params", "load_hf_checkpoint", "local_shard_from_hf", "param_role", "save_hf_checkpoint",
           "unwrap_model"]
