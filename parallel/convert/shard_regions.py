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

__all__ = ["Gathered", "HFTensorParts", "Receipt", "Region", "hf_parts_from_shards", "hf_tensors_from_parts",
           "peer_regions", "shard_regions"]


class Receipt:
    """The works of one ``batch_isend_irecv`` of receives; :meth:`wait` waits for them once."""

    def __init__(self, works):
        self.works = list(works or ())

    def wait(self) -> None:
        while self.works:
            self.works.pop().wait()


@dataclass
class Region:
    """``hf[name].narrow(dim, start, length)`` receives ``src`` (a contiguous view of the shard, shaped like the
    region).  A peer's region received by the stage leader: ``pending`` (a Receipt) is waited before ``src`` is read,
    or, ``src`` None, before the destination it was received into is handed on."""

    name: str
    dim: int
    start: int
    length: int
    src: torch.Tensor | None
    pending: Receipt | None = None

    def write(self, hf: torch.Tensor) -> None:
        """Copy (and cast) ``src`` into its region of the full HF tensor ``hf`` (nothing when received in place)."""
        if self.pending is not None:
            self.pending.wait()
        if self.src is not None:
            hf.narrow(self.dim, self.start, self.length).copy_(self.src)


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
    if kind in ("qkv", "qkv_bias"):  # one region per query group and q/k/v: contiguous rows of shard and HF tensor
        d = spec.head_dim
        nq = spec.num_attention_heads // spec.num_query_groups
        gpr = spec.num_query_groups // tp
        grouped = shard.reshape(gpr, (nq + 2) * d, *shard.shape[1:])
        g0 = tp_rank * gpr
        return [Region(name, 0, (g0 + g) * rows, rows, x[g]) for name, rows, x in
                zip(names, (nq * d, d, d), grouped.split([nq * d, d, d], dim=1)) for g in range(gpr)]
    raise ValueError(f"unknown tensor kind {kind!r}")


@dataclass
class HFTensorParts:
    """One full HF tensor as the regions its TP shards fill, never materialised: :meth:`write` copies (and casts)
    each region straight into a destination (a weight-sync bucket's view), one copy per element."""

    shape: torch.Size
    dtype: torch.dtype
    regions: list[Region]

    def write(self, dst: torch.Tensor) -> None:
        """Fill ``dst`` (shaped like the HF tensor, any dtype) from the shards: the regions at hand first (the
        leader's own shard, while its peers' are still being received), then the received ones."""
        for r in sorted(self.regions, key=lambda r: r.pending is not None):
            r.write(dst)


class Gathered(list):
    """A parameter's TP shards on the stage leader (rank order; a peer's as a meta tensor) and ``regions``, every
    rank's :func:`shard_regions`, its peers' being received (:func:`peer_regions`)."""

    def __init__(self, shards: list[torch.Tensor], regions: list[Region]):
        super().__init__(shards)
        self.regions = regions

    def wait(self) -> None:
        """Wait for every receive (a no-op once written).  One left unwaited (nothing wrote it after a production
        error) would let gloo hand its peer's send to a later receive: the next sync's data shifted, a hang."""
        for r in self.regions:
            if r.pending is not None:
                r.pending.wait()


def peer_regions(role: ParamRole, shard: torch.Tensor, spec, tp: int, pending: Receipt, dest=None,
                 scratch=None) -> list[tuple[int, Region, torch.Tensor]]:
    """``(peer TP rank, Region, where to receive it)`` for every region of every peer's shard (shaped like the
    leader's ``shard``), peers in rank order, each peer's regions in :func:`shard_regions` order (the order that peer
    sends them), each Region's ``pending`` set: ``dest(name)``'s view of the region (``name``'s view in the bucket
    being filled, or None; no ``dest``: none) where it is contiguous and of the shard's dtype and device (``src`` None:
    received in place), else the Region's ``src``, a view of one uint8 buffer of ``scratch(nbytes)`` (default: a new
    one on the shard's device) shared by all such regions."""
    meta = torch.empty(tuple(shard.shape), dtype=shard.dtype, device="meta")
    out, rest, off = [], [], 0
    for rank in range(1, tp):
        for g in shard_regions(role, meta, spec, rank, tp):
            hf = dest(g.name) if dest else None
            into = hf.narrow(g.dim, g.start, g.length) if hf is not None else None
            if into is not None and into.is_contiguous() and (into.dtype, into.device) == (shard.dtype, shard.device):
                g.src = None
            else:
                rest.append((g, off))
                off += g.src.nbytes
            g.pending = pending
            out.append((rank, g, into))
    buf = (scratch or (lambda nbytes: shard.new_empty(nbytes, dtype=torch.uint8)))(off) if off else None
    for g, at in rest:
        g.src = buf[at:at + g.src.nbytes].view(shard.dtype).view(g.src.shape)
    return [(rank, g, into if g.src is None else g.src) for rank, g, into in out]


def hf_tensors_from_parts(role: ParamRole, shards: list[torch.Tensor], spec) -> list[tuple[str, torch.Tensor]]:
    """`layout.hf_tensors_from_shards` of a :class:`Gathered` (its parts written into new tensors on the shards'
    device) or of plain shards."""
    if not isinstance(shards, Gathered):
        return hf_tensors_from_shards(role, shards, spec)
    out = [(n, p, torch.empty(p.shape, dtype=p.dtype, device=shards[0].device))
           for n, p in hf_parts_from_shards(role, shards, spec)]
    for _, p, t in out:
        p.write(t)
    return [(n, t) for n, _, t in out]


def hf_parts_from_shards(role: ParamRole, shards: list[torch.Tensor], spec) -> list[tuple[str, HFTensorParts]]:
    """`layout.hf_tensors_from_shards` without its concatenations: ``[(HF name, HFTensorParts)]`` in
    ``role.hf_names`` order, the same names, shapes and dtypes (taken from it on meta tensors), whose ``write``
    gives bitwise the same values.  ``shards``: one per (expert-)TP rank in rank order (one for ``replicated``), or
    a :class:`Gathered` (its regions).  Raises ValueError for an unknown kind."""
    meta = [torch.empty(tuple(s.shape), dtype=s.dtype, device="meta") for s in shards]
    regions = shards.regions if isinstance(shards, Gathered) else [
        g for r, s in enumerate(shards) for g in shard_regions(role, s, spec, r, len(shards))]
    return [(name, HFTensorParts(t.shape, t.dtype, [g for g in regions if g.name == name]))
            for name, t in hf_tensors_from_shards(role, meta, spec)]
