"""Where one TP rank's shard lands in the HF tensors (pure functions; no communication, no copy).

The per-rank counterpart of `layout.hf_tensors_from_shards`: instead of gathering every rank's shard
and converting, each rank lists the regions of the full HF tensors its own shard fills, so all ranks can
write their part of a shared HF-layout buffer in parallel (the weight sync's single-copy path).  For
column-parallel kinds a rank's rows are contiguous row blocks of the HF tensors (q/k/v per query group,
gate/up); for row-parallel kinds they are column blocks; padded vocabulary rows map nowhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.convert.layout import FC1_KINDS, ParamRole, hf_tensors_from_shards

__all__ = ["HFTensorParts", "Region", "hf_parts_from_shards", "shard_regions"]


@dataclass
class Region:
    """``hf[name].narrow(dim, start, length)`` receives ``src`` (a view of the shard; same numel, shaped
    either like the region or like the region split into ``src.shape[0]`` equal row blocks)."""

    name: str
    dim: int
    start: int
    length: int
    src: torch.Tensor

    def write(self, hf: torch.Tensor) -> None:
        """Copy (and cast) ``src`` into its region of the full HF tensor ``hf``."""
        dst = hf.narrow(self.dim, self.start, self.length)
        if dst.shape != self.src.shape:
            dst = dst.view(self.src.shape)
        dst.copy_(self.src)


def shard_regions(role: ParamRole, shard: torch.Tensor, spec, tp_rank: int, tp: int) -> list[Region]:
    """The HF regions TP rank ``tp_rank`` (of ``tp``) fills with its ``shard`` of a tensor of kind ``role.kind``.

    ``replicated`` tensors are written by rank 0 only (other ranks get no regions).  For expert kinds
    ``tp_rank``/``tp`` are the expert-TP rank and size.  Raises ValueError for an unknown kind.
    """
    kind, names = role.kind, role.hf_names
    if kind == "replicated":
        return [Region(names[0], 0, 0, shard.shape[0], shard)] if tp_rank == 0 else []
    if kind == "vocab":
        per = shard.shape[0]
        start, end = tp_rank * per, min((tp_rank + 1) * per, spec.vocab_size)
        return [Region(names[0], 0, start, end - start, shard[: end - start])] if end > start else []
    if kind in ("row", "expert_row"):
        cols = shard.shape[1]
        return [Region(names[0], 1, tp_rank * cols, cols, shard)]
    if kind == "column":
        rows = shard.shape[0]
        return [Region(names[0], 0, tp_rank * rows, rows, shard)]
    if kind in FC1_KINDS:
        rows = shard.shape[0] // 2
        gate, up = shard.split(rows, 0)
        return [Region(names[0], 0, tp_rank * rows, rows, gate), Region(names[1], 0, tp_rank * rows, rows, up)]
    if kind in ("qkv", "qkv_bias"):
        d = spec.head_dim
        nq = spec.num_attention_heads // spec.num_query_groups
        gpr = spec.num_query_groups // tp
        grouped = shard.reshape(gpr, (nq + 2) * d, *shard.shape[1:])
        q, k, v = grouped.split([nq * d, d, d], dim=1)
        g0 = tp_rank * gpr
        return [Region(names[0], 0, g0 * nq * d, gpr * nq * d, q), Region(names[1], 0, g0 * d, gpr * d, k),
                Region(names[2], 0, g0 * d, gpr * d, v)]
    raise ValueError(f"unknown tensor kind {kind!r}")


@dataclass
class HFTensorParts:
    """One full HF tensor as the regions its TP shards fill, never materialised: :meth:`write` copies (and casts)
    each region straight into a destination (a weight-sync bucket's view), one copy per element."""

    shape: torch.Size
    dtype: torch.dtype
    regions: list[Region]

    def write(self, dst: torch.Tensor) -> None:
        """Fill ``dst`` (shaped like the HF tensor, any dtype) from the shards."""
        for r in self.regions:
            r.write(dst)


def hf_parts_from_shards(role: ParamRole, shards: list[torch.Tensor], spec) -> list[tuple[str, HFTensorParts]]:
    """`layout.hf_tensors_from_shards` without its concatenations: ``[(HF name, HFTensorParts)]`` in
    ``role.hf_names`` order, the same names, shapes and dtypes (taken from it on meta tensors), whose ``write``
    gives bitwise the same values.  ``shards``: one per (expert-)TP rank in rank order (one for ``replicated``).
    Raises ValueError for an unknown kind."""
    meta = [torch.empty(tuple(s.shape), dtype=s.dtype, device="meta") for s in shards]
    regions = [g for r, s in enumerate(shards) for g in shard_regions(role, s, spec, r, len(shards))]
    return [(name, HFTensorParts(t.shape, t.dtype, [g for g in regions if g.name == name]))
            for name, t in hf_tensors_from_shards(role, meta, spec)]
