"""The engine-layout plan: buckets written straight in the engine's parameter layout, per engine TP rank.

The engine's own loaders are the only authority on where an HF tensor's elements land (fused q/k/v, merged
gate/up, padded vocabulary, KV-head replication, TP sharding): once per engine, :func:`engine_loader.probe_layout`
runs them on index tensors inside the engine and reports, per engine TP rank and parameter, runs
``(dst start, global HF index, length)``.  Here that report becomes

* :class:`EngineLayout` -- the parameters (same names, shapes, dtypes on every engine TP rank) and their runs;
* :class:`DirectPlan` -- buckets of engine parameters (each bucket one section per engine TP rank, all sections
  laid out alike) and the JSON header the engine's loader checks;
* :func:`compose_writes` -- per trainer TP rank, the strided block copies from its megatron shards into the
  sections (the megatron -> HF side comes from parallel.convert.shard_regions run on index tensors, the HF ->
  engine side from the probe): each trainer rank writes its elements straight into engine layout, and the engine
  makes one contiguous copy per parameter.

Pure torch; no communication.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from parallel.convert.shard_regions import shard_regions
from rlhf.weight_bridge.bucketing import BucketPlan, TensorMeta, dtype_from_any, plan_buckets
from rlhf.rollout.engine_loader import layout_fingerprint

__all__ = ["LayoutUnavailable", "EngineLayout", "layout_fingerprint", "layout_from_probes", "DirectPlan",
           "build_direct_plan", "compose_writes", "write_section_ops"]

_ALIGN = 64  # bytes between engine-rank sections of a bucket (any dtype's alignment)
_CHUNK = 1 << 22  # elements expanded at once while composing


class LayoutUnavailable(RuntimeError):
    """The engine-layout path cannot serve this sync; the message is the reason (the generic path is used)."""


@dataclass
class EngineLayout:
    """Every engine TP rank's parameters and where their elements come from.

    Attributes: tp_size; params (engine name, per-rank shape, dtype; the same on every rank); runs (per rank:
    ``{name: [R, 3] int64}`` of ``(dst start, global HF index or -1 for zeros, length)``); hf (``{HF name:
    (shape, base)}``); signatures (per rank, :func:`engine_loader.param_signature`); fingerprint.
    """

    tp_size: int
    params: list[TensorMeta]
    runs: list[dict]
    hf: dict
    signatures: list[str]
    fingerprint: str


def layout_from_probes(ranks: list[dict]) -> EngineLayout:
    """An :class:`EngineLayout` from one engine's per-rank probe results.

    Raises:
        LayoutUnavailable: a rank's probe failed, ranks disagree on parameters, or a rank is missing.
    """
    errors = [f"engine TP rank {r.get('tp_rank')}: {r['error']}" for r in ranks if "error" in r]
    if errors:
        raise LayoutUnavailable("; ".join(errors))
    ranks = sorted(ranks, key=lambda r: r["tp_rank"])
    size = ranks[0]["tp_size"]
    if [r["tp_rank"] for r in ranks] != list(range(size)):
        raise LayoutUnavailable(f"probe results of ranks {[r['tp_rank'] for r in ranks]} for engine TP {size}")
    metas = [(n, tuple(s), d) for n, s, d, _ in ranks[0]["params"]]
    for r in ranks[1:]:
        if [(n, tuple(s), d) for n, s, d, _ in r["params"]] != metas:
            raise LayoutUnavailable(f"engine TP rank {r['tp_rank']} holds other parameters (names, shapes or "
                                    f"dtypes) than rank 0")
    return EngineLayout(size, [TensorMeta(n, s, dtype_from_any(d)) for n, s, d in metas],
                        [{n: runs for n, _, _, runs in r["params"]} for r in ranks],
                        {n: (tuple(s), int(b)) for n, s, b in ranks[0]["hf"]},
                        [r["signature"] for r in ranks], layout_fingerprint(ranks))


@dataclass
class DirectPlan:
    """The buckets of an engine-layout sync.  Each bucket's buffer holds ``layout.tp_size`` sections of
    :meth:`stride` bytes; section e is engine TP rank e's payload, laid out as ``bucket.metas`` / ``offsets``."""

    layout: EngineLayout
    buckets: list[BucketPlan]
    key: str
    expected_elements: int = 0
    sent_names: tuple = field(default_factory=tuple)

    @staticmethod
    def stride(bucket: BucketPlan) -> int:
        return -(-bucket.nbytes // _ALIGN) * _ALIGN

    def buffer_bytes(self, bucket: BucketPlan) -> int:
        return self.stride(bucket) * self.layout.tp_size

    def header(self, bucket: BucketPlan) -> str:
        """The JSON header of ``bucket`` (engine_loader's ``load``)."""
        return json.dumps({"op": "load", "fingerprint": self.layout.fingerprint, "signatures": self.layout.signatures,
                           "params": [[m.name, off] for m, off in zip(bucket.metas, bucket.offsets)]})


def build_direct_plan(layout: EngineLayout, sent: dict, bucket_bytes: int) -> DirectPlan:
    """Buckets of the engine's parameters (``bucket_bytes``: a bucket's buffer, all engine-rank sections).

    Args:
        sent: ``{HF name: dtype}`` the generic plan sends (validated against the engine).
    Raises:
        LayoutUnavailable: an engine parameter is fed by an HF tensor that is not sent, or sent in another dtype
            than the parameter's (SGLang's loader would cast it once more).
    """
    names = list(layout.hf)
    bases = torch.tensor([layout.hf[n][1] for n in names], dtype=torch.int64)
    for meta in layout.params:
        for runs in (r[meta.name] for r in layout.runs):
            src = runs[:, 1]
            ids = torch.searchsorted(bases, src[src >= 0], right=True) - 1
            for i in ids.unique().tolist():
                hf_name = names[i]
                if hf_name not in sent:
                    raise LayoutUnavailable(f"engine parameter {meta.name!r} is fed by {hf_name!r}, which the trainer "
                                            f"does not send")
                if sent[hf_name] != meta.dtype:
                    raise LayoutUnavailable(f"{hf_name!r} is sent as {sent[hf_name]} but engine parameter "
                                            f"{meta.name!r} is {meta.dtype}")
    per_rank = max(1, int(bucket_bytes) // layout.tp_size - _ALIGN)
    buckets = plan_buckets(layout.params, per_rank)
    key = hashlib.sha256(f"{layout.fingerprint}|{per_rank}|{sorted(sent.items(), key=str)}".encode()).hexdigest()[:20]
    expected = layout.tp_size * sum(m.numel for m in layout.params)
    return DirectPlan(layout, buckets, key, expected, tuple(sorted(sent)))


def _merge_blocks(dst: list, src: list, lens: list) -> list[tuple]:
    """Runs (sorted by dst) -> strided blocks ``(count, length, dst0, dst_stride, src0, src_stride)``."""
    blocks: list[list] = []
    for d, s, n in zip(dst, src, lens):
        if blocks:
            b = blocks[-1]
            if b[1] == n:
                if b[0] == 1 and d - b[2] >= n and s >= b[4]:  # as_strided takes no negative strides
                    b[0], b[3], b[5] = 2, d - b[2], s - b[4]
                    continue
                if b[0] > 1 and d == b[2] + b[0] * b[3] and s == b[4] + b[0] * b[5]:
                    b[0] += 1
                    continue
        blocks.append([1, n, d, n, s, n])
    return [tuple(b) for b in blocks]


def _local_runs(hfmap: torch.Tensor, base: int, runs: torch.Tensor):
    """Where ``runs`` (engine dst, global src, length) find this rank's local elements: (dst, local src, len)."""
    out_d, out_s, out_l = [], [], []
    lens = runs[:, 2]
    start = 0
    while start < runs.shape[0]:  # chunks of at most _CHUNK expanded elements (one run may exceed it alone)
        stop, acc = start, 0
        while stop < runs.shape[0] and (stop == start or acc + int(lens[stop]) <= _CHUNK):
            acc += int(lens[stop])
            stop += 1
        part = runs[start:stop]
        n = part[:, 2]
        total = int(n.sum())
        first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        offs = torch.arange(total) - first
        dpos = torch.repeat_interleave(part[:, 0], n) + offs
        vals = hfmap[torch.repeat_interleave(part[:, 1] - base, n) + offs]
        valid = vals >= 0
        brk = torch.ones(total, dtype=torch.bool)
        if total > 1:
            brk[1:] = ~((vals[1:] == vals[:-1] + 1) & (dpos[1:] == dpos[:-1] + 1) & valid[:-1])
        starts = brk.nonzero().squeeze(1)
        seg = torch.diff(starts, append=torch.tensor([total]))
        keep = valid[starts]
        out_d += dpos[starts][keep].tolist()
        out_s += vals[starts][keep].tolist()
        out_l += seg[keep].tolist()
        start = stop
    return out_d, out_s, out_l


def compose_writes(plan: DirectPlan, entries, spec, tp_rank: int, tp_size: int) -> tuple[list[list], int]:
    """This trainer rank's writes of every bucket and the number of elements they cover.

    Args:
        entries: this rank's LocalTensors (parallel.convert), whose shards are written.
        spec, tp_rank, tp_size: the model spec and this rank's trainer TP position.
    Returns:
        (ops, covered): ``ops[k]`` lists ``(engine rank, byte offset in the section, nbytes, dtype, entry index or
        -1 for zeros, blocks)`` of bucket k (blocks as in :func:`_merge_blocks`, in elements of the parameter and
        of the entry's flattened tensor); ``covered`` counts the engine elements written (zeros by rank 0 only).
    Raises:
        LayoutUnavailable: a shard is not contiguous.
    """
    layout = plan.layout
    names = list(layout.hf)
    bases = torch.tensor([layout.hf[n][1] for n in names], dtype=torch.int64)
    owner = {}
    for i, e in enumerate(entries):
        for n in e.role.hf_names:
            owner[n] = i
    by_hf: dict[int, list] = {}
    ops: list[list] = [[] for _ in plan.buckets]
    covered = 0
    for k, bucket in enumerate(plan.buckets):
        for meta, off in zip(bucket.metas, bucket.offsets):
            for e in range(layout.tp_size):
                runs = layout.runs[e][meta.name]
                zeros = runs[runs[:, 1] == -1]
                if zeros.shape[0] and tp_rank == 0:
                    blocks = _merge_blocks(zeros[:, 0].tolist(), [0] * zeros.shape[0], zeros[:, 2].tolist())
                    ops[k].append((e, off, meta.nbytes, meta.dtype, -1, blocks))
                    covered += int(zeros[:, 2].sum())
                real = runs[runs[:, 1] >= 0]
                ids = torch.searchsorted(bases, real[:, 1], right=True) - 1
                for i in ids.unique().tolist():
                    by_hf.setdefault(i, []).append((k, e, off, meta, real[ids == i]))
    for i, uses in by_hf.items():
        name = names[i]
        ent = owner.get(name)
        if ent is None:
            continue  # another trainer rank (or nobody: the coverage check catches it)
        e_t = entries[ent].tensor
        if not e_t.is_contiguous():
            raise LayoutUnavailable(f"{entries[ent].local_name}: a non-contiguous shard cannot be written by blocks")
        shape, base = layout.hf[name]
        hfmap = torch.full(shape, -1, dtype=torch.int64)
        index = torch.arange(e_t.numel(), dtype=torch.int64).view(e_t.shape)
        for reg in shard_regions(entries[ent].role, index, spec, tp_rank, tp_size):
            if reg.name == name:
                reg.write(hfmap)
        hfmap = hfmap.view(-1)
        for k, e, off, meta, runs in uses:
            d, s, n = _local_runs(hfmap, base, runs)
            if d:
                order = sorted(range(len(d)), key=d.__getitem__)
                blocks = _merge_blocks([d[j] for j in order], [s[j] for j in order], [n[j] for j in order])
                ops[k].append((e, off, meta.nbytes, meta.dtype, ent, blocks))
                covered += sum(n)
        del hfmap, index
    return ops, covered


def write_section_ops(ops: list, buf: torch.Tensor, stride: int, flats: list) -> None:
    """Run one bucket's ops (:func:`compose_writes`) into its flat uint8 ``buf``; ``flats[i]`` is entry i's
    tensor flattened (a view)."""
    with torch.no_grad():
        for e, off, nbytes, dtype, ent, blocks in ops:
            start = e * stride + off
            dst = buf[start:start + nbytes].view(dtype)
            d_off = dst.storage_offset()
            if ent < 0:
                for cnt, n, d0, ds, _s0, _ss in blocks:
                    dst.as_strided((cnt, n), (ds, 1), d_off + d0).zero_()
                continue
            src = flats[ent]
            s_off = src.storage_offset()
            for cnt, n, d0, ds, s0, ss in blocks:
                dst.as_strided((cnt, n), (ds, 1), d_off + d0).copy_(src.as_strided((cnt, n), (ss, 1), s_off + s0))


def fetch_layout(engines, known: str | None = None) -> EngineLayout | str:
    """Controller: the engines' common layout (``known``: the fingerprint already held; then the engines only
    confirm it and ``known`` comes back).  Raises LayoutUnavailable: an engine could not derive its layout, or the
    engines' layouts differ."""
    got = engines.weight_layout(known=known)
    errors = [f"engine {i}: {g['error']}" for i, g in enumerate(got) if g is None or "error" in g]
    if errors:
        raise LayoutUnavailable("; ".join(errors))
    fps = {g["fingerprint"] for g in got}
    if len(fps) != 1:
        raise LayoutUnavailable(f"the engines hold different parameter layouts {sorted(fps)}")
    full = next((g for g in got if "ranks" in g), None)
    if full is None:
        return known
    return layout_from_probes(full["ranks"])


def agree(plan: DirectPlan, outcomes: list) -> str | None:
    """Every rank's ``(error or None, covered elements)`` of :func:`compose_writes` -> None when the plan's
    writes cover every engine element exactly once, else the reason the generic path must be used."""
    errors = [e for e, _ in outcomes if e]
    if errors:
        return "; ".join(dict.fromkeys(errors))
    covered = sum(c for _, c in outcomes)
    if covered != plan.expected_elements:
        return (f"the trainer's shards cover {covered} of the engine's {plan.expected_elements} parameter elements "
                f"(an engine parameter mixes tensors the trainer does not send this way)")
    return None
