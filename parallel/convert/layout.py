"""How megatron-core shards and packs each kind of tensor, in both directions (pure functions).

Kinds (`ParamRole.kind`):

* ``replicated``: the same full tensor on every TP rank (norms, q/k norms, MoE router).
* ``row``: TP splits dim 1 (attention output projection, MLP down projection).
* ``vocab``: TP splits dim 0 of the vocabulary, padded to a multiple of
  make_vocab_size_divisible_by * tp with zero rows (embedding, untied output layer).
* ``qkv`` / ``qkv_bias``: `linear_qkv` interleaved per query group: for each of the G groups,
  its num_heads / G q heads, then its k head, then its v head; TP ranks hold whole groups.
* ``column``: TP splits dim 0 into contiguous row blocks (MLA's q/kv down and up projections).
* ``fc1`` / ``shared_fc1``: SwiGLU `linear_fc1` is [gate; up], each split separately over TP: rank r holds
  [gate_r; up_r]; ``shared_fc1`` is a MoE layer's shared experts (sized `moe_shared_ffn_hidden_size`).
* ``expert_fc1`` / ``expert_row``: a routed expert's fc1 / fc2, laid out like ``fc1`` / ``row``
  but split over the *expert* tensor-parallel group; each expert lives on one expert-parallel
  rank only.

`local_shard_from_hf` (import) and `hf_tensors_from_shards` (export) are inverses; the HF side
is read through `HFCheckpointReader` slices, so a rank never loads more than its shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GATHER_DIM = {"replicated": None, "vocab": 0, "row": 1, "column": 0, "fc1": 0, "shared_fc1": 0, "qkv": 0,
              "qkv_bias": 0, "expert_fc1": 0, "expert_row": 1}
"""Kind -> the dim along which TP shards are concatenated (None: replicated, nothing to gather)."""

EXPERT_KINDS = frozenset({"expert_fc1", "expert_row"})
FC1_KINDS = frozenset({"fc1", "shared_fc1", "expert_fc1"})
"""Kinds packed [gate; up] with each half split over (expert-)TP."""


@dataclass(frozen=True)
class ParamRole:
    """How one local megatron tensor maps onto HF tensors: its kind and HF name(s) in pack order
    (q, k, v for ``qkv``; gate, up for ``fc1``/``expert_fc1``)."""

    kind: str  # a key of GATHER_DIM
    hf_names: tuple[str, ...]

    @property
    def is_expert(self) -> bool:
        """True for routed-expert tensors: gathered over the expert-TP group, one EP rank owns each."""
        return self.kind in EXPERT_KINDS


def _expected_hf_shapes(role: ParamRole, spec) -> dict[str, list[int]]:
    d, H = spec.head_dim, spec.hidden_size
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_query_groups * d
    if role.kind == "qkv":
        return dict(zip(role.hf_names, ([q_rows, H], [kv_rows, H], [kv_rows, H])))
    if role.kind == "qkv_bias":
        return dict(zip(role.hf_names, ([q_rows], [kv_rows], [kv_rows])))
    if role.kind == "fc1":
        return {n: [spec.ffn_hidden_size, H] for n in role.hf_names}
    if role.kind == "shared_fc1":
        return {n: [spec.moe_shared_ffn_hidden_size, H] for n in role.hf_names}
    if role.kind == "expert_fc1":
        return {n: [spec.moe_ffn_hidden_size, H] for n in role.hf_names}
    if role.kind == "expert_row":
        return {role.hf_names[0]: [H, spec.moe_ffn_hidden_size]}
    if role.kind == "vocab":
        return {role.hf_names[0]: [spec.vocab_size, H]}
    return {}


def check_hf_shapes(reader, role: ParamRole, spec) -> None:
    """Raise ValueError when a HF tensor's shape disagrees with the model config (before any copy)."""
    for name, shape in _expected_hf_shapes(role, spec).items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} has shape {got} in {reader.path!r}, expected {shape} "
                             f"from the model config; config and weights do not match")


def _local_vocab_shard(reader, name, param, tp_rank, vocab_size):
    rows_per_rank = param.shape[0]
    start = tp_rank * rows_per_rank
    end = min(start + rows_per_rank, vocab_size)
    out = torch.zeros_like(param)
    if end > start:
        out[: end - start] = reader.get(name, slice(start, end))
    return out


def local_shard_from_hf(reader, role: ParamRole, param: torch.Tensor, spec, tp_rank: int, tp: int) -> torch.Tensor:
    """Build this TP rank's shard of one megatron tensor from the HF checkpoint.

    `param` is the local megatron tensor (only its shape is used); for expert kinds `tp_rank`/`tp`
    are the expert-TP rank and size.  Returns a CPU tensor shaped like `param`, in the
    checkpoint's dtype.  Raises KeyError for a missing HF tensor, ValueError for a shape that
    disagrees with the config.
    """
    check_hf_shapes(reader, role, spec)
    kind = role.kind
    if kind == "replicated":
        return reader.get(role.hf_names[0])
    if kind == "vocab":
        return _local_vocab_shard(reader, role.hf_names[0], param, tp_rank, spec.vocab_size)
    if kind in ("row", "expert_row"):
        cols = param.shape[1]
        return reader.get(role.hf_names[0], cols=slice(tp_rank * cols, (tp_rank + 1) * cols))
    if kind == "column":
        rows, full = param.shape[0], reader.shape(role.hf_names[0])
        if full[0] != rows * tp:
            raise ValueError(f"tensor {role.hf_names[0]!r} has shape {full} in {reader.path!r}, expected "
                             f"{rows * tp} rows ({rows} per rank x tp={tp}) from the model config")
        return reader.get(role.hf_names[0], slice(tp_rank * rows, (tp_rank + 1) * rows))
    if kind in FC1_KINDS:
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
    raise ValueError(f"unknown tensor kind {kind!r}; use one of {sorted(GATHER_DIM)}")


def hf_tensors_from_shards(role: ParamRole, shards: list[torch.Tensor], spec) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `local_shard_from_hf`: the TP shards (rank order) of one tensor -> HF tensors.

    shards: one tensor for ``replicated``, else one per (expert-)TP rank.  Returns
    [(HF name, full tensor)] in `role.hf_names` order (views where possible; padded vocab rows
    trimmed).  Pure function (no communication): works on meta tensors, so the weight bridge
    plans names and shapes with the very code that converts the data.
    """
    kind = role.kind
    if kind == "replicated":
        return [(role.hf_names[0], shards[0])]
    if kind == "vocab":
        return [(role.hf_names[0], torch.cat(shards, 0)[: spec.vocab_size])]
    if kind in ("row", "expert_row"):
        return [(role.hf_names[0], torch.cat(shards, 1))]
    if kind == "column":
        return [(role.hf_names[0], torch.cat(shards, 0))]
    if kind in FC1_KINDS:
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
    raise ValueError(f"unknown tensor kind {kind!r}; use one of {sorted(GATHER_DIM)}")
