"""Hugging Face <-> megatron-core weight layout for Llama/Qwen2 GPTModels.

The two directions share one name map, so the round trip HF -> Megatron -> HF is exact:

* import (`load_hf_checkpoint`): every rank reads, with safetensors slices, only the rows and
  columns of its own TP shard of the layers of its own PP (and VPP) stage.  No rank ever holds
  the full model.
* export (`iter_hf_tensors`): one parameter at a time, the TP group all-gathers the shards into
  the full HF tensor (padded vocab rows trimmed).  Used by `save_hf_checkpoint` (each PP stage
  writes its own safetensors file) and by the weight bridge (issue: rollout sync).

Megatron layouts handled here (local and Transformer Engine specs):

* `linear_qkv` is interleaved per query group: for each of the G groups, the group's q heads
  (num_heads / G of them), then its k head, then its v head; TP ranks hold whole groups.
* `linear_fc1` (SwiGLU) is [gate; up], each split separately over TP: rank r holds [gate_r; up_r].
* the vocabulary is padded to a multiple of make_vocab_size_divisible_by * tp (zero rows).
* under PP/VPP each chunk numbers its layers from 0; the global index is `layer_number - 1`.
* tied embeddings: the last PP stage holds a copy `output_layer.weight` of the embedding.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from rlhf.mcore.model_config import HFModelSpec

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# megatron local-name suffix -> (HF suffix, kind).  Kinds: "replicated", "row" (TP splits dim 1),
# "qkv", "qkv_bias", "fc1".  TE spec fuses the norms into the following linear layer.
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight", "replicated"),
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", "replicated"),
    "self_attention.linear_qkv.weight": (None, "qkv"),
    "self_attention.linear_qkv.bias": (None, "qkv_bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", "row"),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", "replicated"),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight", "replicated"),
    "mlp.linear_fc1.weight": (None, "fc1"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", "row"),
}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


@dataclass(frozen=True)
class ParamRole:
    """How one local megatron parameter maps onto HF tensors."""

    kind: str  # replicated | row | vocab | qkv | qkv_bias | fc1
    hf_names: tuple[str, ...]


def param_role(local_name: str, module, spec: HFModelSpec) -> ParamRole | None:
    """Map a local megatron parameter name of `module` (one GPTModel chunk) to its HF tensors.

    Returns None for parameters that have no HF counterpart (e.g. the critic's value head).
    Raises KeyError for an unknown megatron name.
    """
    if local_name == "embedding.word_embeddings.weight":
        return ParamRole("vocab", ("model.embed_tokens.weight",))
    if local_name == "output_layer.weight":
        if getattr(module, "is_value_model", False):
            return None
        if spec.tie_word_embeddings:
            return ParamRole("vocab", ("model.embed_tokens.weight",))
        return ParamRole("vocab", ("lm_head.weight",))
    if local_name == "decoder.final_layernorm.weight":
        return ParamRole("replicated", ("model.norm.weight",))
    m = _LAYER_RE.match(local_name)
    if not m or m.group(2) not in _LAYER_MAP:
        raise KeyError(f"no Hugging Face mapping for megatron parameter {local_name!r}")
    global_layer = module.decoder.layers[int(m.group(1))].layer_number - 1
    prefix = f"model.layers.{global_layer}."
    hf_suffix, kind = _LAYER_MAP[m.group(2)]
    if kind == "qkv":
        return ParamRole(kind, tuple(prefix + n + ".weight" for n in _QKV))
    if kind == "qkv_bias":
        return ParamRole(kind, tuple(prefix + n + ".bias" for n in _QKV))
    if kind == "fc1":
        return ParamRole(kind, (prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"))
    return ParamRole(kind, (prefix + hf_suffix,))


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


# ----------------------------------------------------------------------------------------------
# import
# ----------------------------------------------------------------------------------------------
class HFCheckpointReader:
    """Lazy reader of a HF safetensors checkpoint (single file or sharded with an index).

    `get(name, rows=None, cols=None)` reads only the requested slice. Raises FileNotFoundError
    when the directory holds no safetensors, KeyError naming a missing tensor.
    """

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            weight_map = None
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}; "
                                    f"convert .bin checkpoints to safetensors first")
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        if weight_map is None:
            h = self._stack.enter_context(safe_open(os.path.join(path, "model.safetensors"), "pt"))
            self.weight_map = {k: "model.safetensors" for k in h.keys()}
            self._handles["model.safetensors"] = h
        else:
            self.weight_map = weight_map
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the Hugging Face checkpoint at {self.path!r}")
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = self._stack.enter_context(self._safe_open(os.path.join(self.path, fname), "pt"))
        return self._handles[fname]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        sl = self._handle(name).get_slice(name)
        if rows is None and cols is None:
            return sl[:]
        if cols is None:
            return sl[rows]
        return sl[rows if rows is not None else slice(None), cols]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _local_vocab_shard(reader, name, param, tp_rank, tp, vocab_size):
    rows_per_rank = param.shape[0]
    start = tp_rank * rows_per_rank
    end = min(start + rows_per_rank, vocab_size)
    out = torch.zeros_like(param)
    if end > start:
        out[: end - start] = reader.get(name, slice(start, end))
    return out


def _expected_shape(reader, role: ParamRole, spec: HFModelSpec) -> None:
    d, H = spec.head_dim, spec.hidden_size
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_query_groups * d
    expect = {}
    if role.kind == "qkv":
        expect = dict(zip(role.hf_names, ([q_rows, H], [kv_rows, H], [kv_rows, H])))
    elif role.kind == "qkv_bias":
        expect = dict(zip(role.hf_names, ([q_rows], [kv_rows], [kv_rows])))
    elif role.kind == "fc1":
        expect = {n: [spec.ffn_hidden_size, H] for n in role.hf_names}
    elif role.kind == "vocab":
        expect = {role.hf_names[0]: [spec.vocab_size, H]}
    for name, shape in expect.items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} has shape {got} in {reader.path!r}, expected {shape} "
                             f"from the model config; config and weights do not match")


def local_shard_from_hf(reader: HFCheckpointReader, role: ParamRole, param: torch.Tensor,
                        spec: HFModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """Build this TP rank's shard of one megatron parameter from the HF checkpoint.

    Returns a tensor shaped like `param` (dtype of the checkpoint). Raises KeyError for a
    missing HF tensor and ValueError for a shape that disagrees with the config.
    """
    _expected_shape(reader, role, spec)
    kind = role.kind
    if kind == "replicated":
        return reader.get(role.hf_names[0])
    if kind == "vocab":
        return _local_vocab_shard(reader, role.hf_names[0], param, tp_rank, tp, spec.vocab_size)
    if kind == "row":
        cols = param.shape[1]
        return reader.get(role.hf_names[0], cols=slice(tp_rank * cols, (tp_rank + 1) * cols))
    if kind == "fc1":
        rows = param.shape[0] // 2
        sl = slice(tp_rank * rows, (tp_rank + 1) * rows)
        return torch.cat([reader.get(role.hf_names[0], sl), reader.get(role.hf_names[1], sl)], 0)
    if kind in ("qkv", "qkv_bias"):
        d = spec.head_dim
        groups_per_rank = spec.num_query_groups // tp
        q_per_group = spec.num_attention_heads // spec.num_query_groups
        parts = []
        for g in range(tp_rank * groups_per_rank, (tp_rank + 1) * groups_per_rank):
            parts.append(reader.get(role.hf_names[0], slice(g * q_per_group * d, (g + 1) * q_per_group * d)))
            parts.append(reader.get(role.hf_names[1], slice(g * d, (g + 1) * d)))
            parts.append(reader.get(role.hf_names[2], slice(g * d, (g + 1) * d)))
        return torch.cat(parts, 0)
    raise AssertionError(kind)


@torch.no_grad()
def load_hf_checkpoint(model_chunks, hf_path: str, spec: HFModelSpec) -> int:
    """Load a HF safetensors checkpoint into the local shards of `model_chunks` (list of GPTModel).

    Each rank reads only its own slices. Parameters without a HF counterpart (value head) keep
    their initialisation. Returns the number of parameters loaded. Raises KeyError naming a
    tensor missing from the checkpoint, ValueError on a shape mismatch (before any copy).
    """
    tp_rank, tp = _tp()
    n = 0
    with HFCheckpointReader(hf_path) as reader:
        for chunk in model_chunks:
            chunk = unwrap_model(chunk)
            for name, param in chunk.named_parameters():
                role = param_role(name, chunk, spec)
                if role is None:
                    continue
                shard = local_shard_from_hf(reader, role, param, spec, tp_rank, tp)
                if shard.shape != param.shape:
                    raise ValueError(f"{name}: shard from {role.hf_names} has shape {tuple(shard.shape)}, "
                                     f"megatron parameter has {tuple(param.shape)}")
                param.copy_(shard)
                n += 1
    return n


def unwrap_model(model):
    """Strip DDP / Float16Module wrappers down to the GPTModel."""
    while hasattr(model, "module"):
        model = model.module
    return model


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------
def _gather_tp(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(out, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return out


def hf_tensors_from_shards(role: ParamRole, shards: list[torch.Tensor], spec: HFModelSpec) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `local_shard_from_hf`: the TP shards (rank order) of one parameter -> HF tensors.

    Pure function (no communication), so the weight bridge and tests can call it directly.
    """
    kind = role.kind
    if kind == "replicated":
        return [(role.hf_names[0], shards[0])]
    if kind == "vocab":
        return [(role.hf_names[0], torch.cat(shards, 0)[: spec.vocab_size])]
    if kind == "row":
        return [(role.hf_names[0], torch.cat(shards, 1))]
    if kind == "fc1":
        gates, ups = zip(*(s.chunk(2, 0) for s in shards))
        return [(role.hf_names[0], torch.cat(gates, 0)), (role.hf_names[1], torch.cat(ups, 0))]
    if kind in ("qkv", "qkv_bias"):
        d = spec.head_dim
        q_per_group = spec.num_attention_heads // spec.num_query_groups
        full = torch.cat(shards, 0)
        grouped = full.reshape(spec.num_query_groups, (q_per_group + 2) * d, *full.shape[1:])
        q, k, v = grouped.split([q_per_group * d, d, d], dim=1)
        tail = full.shape[1:]
        return [(role.hf_names[0], q.reshape(-1, *tail)), (role.hf_names[1], k.reshape(-1, *tail)),
                (role.hf_names[2], v.reshape(-1, *tail))]
    raise AssertionError(kind)


GATHER_DIM = {"replicated": None, "vocab": 0, "row": 1, "fc1": 0, "qkv": 0, "qkv_bias": 0}


def iter_local_params(model_chunks, spec: HFModelSpec, include_value_head: bool = False):
    """Yield (chunk, local_name, tensor, role) for every parameter (and persistent buffer) this
    rank holds, in a deterministic order identical on all TP ranks of a stage.

    Tied embeddings: the last stage's `output_layer.weight` copy is skipped (HF exports no
    separate lm_head for tied models).
    """
    for chunk in model_chunks:
        chunk = unwrap_model(chunk)
        param_names = {n for n, _ in chunk.named_parameters()}
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if tensor is None or name.endswith("_extra_state") or not torch.is_tensor(tensor):
                continue
            if name == "output_layer.weight" and spec.tie_word_embeddings and not getattr(chunk, "is_value_model", False):
                continue
            try:
                role = param_role(name, chunk, spec)
            except KeyError:
                if name in param_names:
                    raise  # an unmapped parameter is a bug; an unmapped persistent buffer has no HF tensor
                continue
            if role is None and not include_value_head:
                continue
            yield chunk, name, tensor, role


@torch.no_grad()
def iter_hf_tensors(model_chunks, spec: HFModelSpec, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every HF tensor whose megatron parameter lives on this PP
    stage. All ranks of the TP group must iterate together (one all-gather per parameter); every
    TP rank receives the full tensor. Peak extra memory: one full parameter.
    """
    for _chunk, _name, tensor, role in iter_local_params(model_chunks, spec):
        dim = GATHER_DIM[role.kind]
        shards = [tensor.detach()] if dim is None else _gather_tp(tensor.detach(), dim)
        for hf_name, t in hf_tensors_from_shards(role, shards, spec):
            yield hf_name, (t if dtype is None else t.to(dtype)).contiguous()


def save_hf_checkpoint(model_chunks, spec: HFModelSpec, hf_config, out_dir: str, tokenizer=None,
                       dtype: torch.dtype | None = None) -> None:
    """Write the model as a HF directory (config, safetensors, tokenizer) loadable with
    `AutoModelForCausalLM.from_pretrained(out_dir)`.

    Collective over the whole job. Each PP stage's (tp 0, dp 0) rank writes its own shard file;
    global rank 0 writes config, tokenizer and the index. Files appear atomically (tmp + rename).
    """
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
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
