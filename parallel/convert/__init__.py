"""Hugging Face <-> megatron-core weight conversion.

Layout of this package (one job per module):

* `registry`: the converter registry, HF `architectures[0]` -> `ModelFamily`
  (`get_converter`, `resolve_architecture`, `supported_architectures`, `CONVERTERS`);
* one file per model family with ONE name map used in both directions: `llama` (Llama 2/3.x,
  Qwen2/2.5, Mistral), `qwen3` (Qwen3 dense and Qwen3-MoE), `mixtral` (Mixtral);
* `spec`: `HFModelSpec` (the config facts) and `UnsupportedModelError`;
* `layout`: how megatron shards/packs each tensor kind (`ParamRole`, `GATHER_DIM`,
  `local_shard_from_hf`, `hf_tensors_from_shards`), pure functions;
* `params`: `param_role` and the one parameter walk (`walk_local_tensors`, `iter_local_params`);
* `hf_io`: safetensors I/O through `safetensors.safe_open` (`HFCheckpointReader`,
  `read_checkpoint_metadata`);
* `hf_import` (`load_hf_checkpoint`) and `hf_export` (`iter_hf_tensors`, `save_hf_checkpoint`).

The registry lives in `registry.py` rather than here so the machinery modules can look families
up without importing this package's `__init__` (no import cycle).
"""
from parallel.convert.family import ModelFamily
from parallel.convert.hf_export import iter_hf_tensors, save_hf_checkpoint
from parallel.convert.hf_import import load_hf_checkpoint, shard_rank_and_size
from parallel.convert.hf_io import HFCheckpointReader, read_checkpoint_metadata
from parallel.convert.layout import GATHER_DIM, ParamRole, hf_tensors_from_shards, local_shard_from_hf
from parallel.convert.params import (LocalTensor, iter_local_params, param_role, regex_name_map, unwrap_model,
                                     walk_local_tensors)
from parallel.convert.registry import (CONVERTERS, get_converter, resolve_architecture,
                                         supported_architectures)
from parallel.convert.spec import HFModelSpec, UnsupportedModelError

__all__ = ["CONVERTERS", "GATHER_DIM", "HFCheckpointReader", "HFModelSpec", "LocalTensor", "ModelFamily",
           "ParamRole", "regex_name_map", "UnsupportedModelError", "get_converter", "hf_tensors_from_shards", "iter_hf_tensors",
           "iter_local_params", "load_hf_checkpoint", "local_shard_from_hf", "param_role",
           "read_checkpoint_metadata", "resolve_architecture", "save_hf_checkpoint", "shard_rank_and_size",
           "supported_architectures", "unwrap_model", "walk_local_tensors"]
