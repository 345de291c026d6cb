"""The engine-layout plan: buckets written straight in the engine's parameter layout, per engine TP rank.

The engine's own loaders are the only authority on where an HF tensor's elements land (fused q/k/v, merged
gate/up, padded vocabulary, KV-head replication, experts, TP sharding): once per engine,
rlhf.rollout.engine_probe.probe_layout runs them on index tensors inside the engine and reports, per engine TP
rank, maps ("templates": one per distinct decoder-layer shape, plus the tensors outside the layers) of runs
``(dst start, HF slot, offset, length)`` and which template each layer uses.  Here that report becomes

* :class:`EngineLayout` -- the templates (same names, shapes, dtypes on every engine TP rank; runs per rank) and
  the groups (layer, template);
* :class:`DirectPlan` -- per pipeline stage, buckets of the engine parameters that stage's tensors feed (each
  bucket one section per engine TP rank, all sections laid out alike) and the JSON header the engine's loader
  checks;
* :func:`compose_writes` -- per trainer rank, strided block copies from its megatron shards into the sections.  The
  megatron -> HF side is the converter's own ``shard_regions`` evaluated on meta tensors (strides only, no data);
  the HF -> engine side is the probe's runs; the two are intersected as intervals (never element by element) once
  per template and reused for every layer of that template.

Pure torch; no communication.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from parallel.convert.shard_regions import shard_regions
from rlhf.rollout.engine_probe import expand_name, layout_fingerprint
from rlhf.weight_bridge.bucketing import BucketPlan, TensorMeta, dtype_from_any, plan_buckets
from rlhf.weight_bridge.plan import SendPlan, StagePlan

__all__ = ["LayoutUnavailable", "Template", "EngineLayout", "layout_fingerprint", "layout_from_probes", "DirectPlan",
           "build_direct_plan", "compose_writes", "write_section_ops", "fetch_layout", "agree"]

_ALIGN = 64  # bytes between engine-rank sections of a bucket (any dtype's alignment)


class LayoutUnavailable(RuntimeError):
    """The engine-layout path cannot serve this sync; the message is the reason (the generic path is used)."""


@dataclass
class Template:
    """One map: HF tensors ``hf`` (relative names with ``{L}``, shapes) into parameters ``params`` (relative names,
    per-rank shapes, dtypes); ``runs[e][i]``: engine TP rank e's ``[R, 4]`` runs of parameter i."""

    hf: list
    params: list[TensorMeta]
    runs: list[list[torch.Tensor]]


@dataclass
class EngineLayout:
    """Every engine TP rank's parameters and where their elements come from.

    Attributes: tp_size; templates; groups (``[(layer or None, template index)]``); signatures (per rank,
    rlhf.rollout.engine_probe.param_signature); fingerprint.
    """

    tp_size: int
    templates: list[Template]
    groups: list[tuple]
    signatures: list[str]
    fingerprint: str

    def parameters(self):
        """``(TensorMeta with the full name, group index, parameter index in the template)`` of every parameter."""
        for g, (layer, tid) in enumerate(self.groups):
            for i, m in enumerate(self.templates[tid].params):
                yield TensorMeta(expand_name(m.name, layer), m.shape, m.dtype), g, i


def layout_from_probes(ranks: list[dict]) -> EngineLayout:
    """An :class:`EngineLayout` from one engine's per-rank probe results.

    Raises:
        LayoutUnavailable: a rank's probe failed, ranks disagree on parameters or groups, or a rank is missing.
    """
    errors = [f"engine TP rank {r.get('tp_rank')}: {r['error']}" for r in ranks if "error" in r]
    if errors:
        raise LayoutUnavailable("; ".join(errors))
    ranks = sorted(ranks, key=lambda r: r["tp_rank"])
    size = ranks[0]["tp_size"]
    if [r["tp_rank"] for r in ranks] != list(range(size)):
        raise LayoutUnavailable(f"probe results of ranks {[r['tp_rank'] for r in ranks]} for engine TP {size}")

    def shape_of(r):
        return ([tuple(g) for g in r["groups"]],
                [([(n, tuple(s)) for n, s in t["hf"]], [(n, tuple(s), d) for n, s, d, _ in t["params"]])
                 for t in r["templates"]])

    first = shape_of(ranks[0])
    for r in ranks[1:]:
        if shape_of(r) != first:
            raise LayoutUnavailable(f"engine TP rank {r['tp_rank']} holds other parameters (names, shapes, dtypes or "
                                    f"layer groups) than rank 0")
    templates = [Template(hf, [TensorMeta(n, s, dtype_from_any(d)) for n, s, d in params],
                          [[runs for *_, runs in r["templates"][t]["params"]] for r in ranks])
                 for t, (hf, params) in enumerate(first[1])]
    return EngineLayout(size, templates, first[0], [r["signature"] for r in ranks], layout_fingerprint(ranks))


@dataclass
class DirectPlan:
    """The buckets of an engine-layout sync, per pipeline stage (``send``: the stages' StagePlans, whose ``metas``
    and buckets hold engine parameters).  Each bucket's buffer holds ``layout.tp_size`` sections of
    :meth:`stride` bytes; section e is engine TP rank e's payload, laid out as ``bucket.metas`` / ``offsets``."""

    layout: EngineLayout
    send: SendPlan
    where: dict  # engine parameter name -> (group index, parameter index in its template)
    key: str
    expected_elements: int = 0
    sent_names: tuple = field(default_factory=tuple)
    arenas: list | None = None  # zero copy (shared_params.py): per engine, per TP rank (manager, file, bytes)

    @property
    def buckets(self) -> list[BucketPlan]:
        return [b for s in self.send.stages for b in s.buckets]

    def stage(self, pp_rank: int) -> StagePlan | None:
        return next((s for s in self.send.stages if s.pp_rank == pp_rank), None)

    @staticmethod
    def stride(bucket: BucketPlan) -> int:
        return -(-bucket.nbytes // _ALIGN) * _ALIGN

    def buffer_bytes(self, bucket: BucketPlan) -> int:
        return self.stride(bucket) * self.layout.tp_size

    def header(self, bucket: BucketPlan, last: bool = False) -> str:
        """The JSON header of ``bucket`` (engine_loader's ``load``); ``last``: the sync's last bucket."""
        return json.dumps({"op": "load", "fingerprint": self.layout.fingerprint, "signatures": self.layout.signatures,
                           "params": [[m.name, off] for m, off in zip(bucket.metas, bucket.offsets)],
                           "last": bool(last)})


def _slots(t: Template, i: int) -> list[int]:
    """HF slots parameter i of template t is fed by, on any engine rank."""
    return sorted({s for per_rank in t.runs for s in per_rank[i][:, 1].unique().tolist() if s >= 0})


def build_direct_plan(layout: EngineLayout, stages: list[tuple], bucket_bytes: int) -> DirectPlan:
    """Per-stage buckets of the engine's parameters (``bucket_bytes``: a bucket's buffer, all engine-rank sections).

    Args:
        stages: ``[(pp rank, leader rank, {HF name: dtype}) ]`` the generic plan sends (validated against the
            engine), in stage order.
    Raises:
        LayoutUnavailable: an engine parameter is fed by an HF tensor that is not sent, sent in another dtype than
            the parameter's (SGLang's loader would cast it once more), or by tensors of two pipeline stages.
    """
    stage_of = {n: k for k, (_, _, sent) in enumerate(stages) for n in sent}
    per_stage: list[list[TensorMeta]] = [[] for _ in stages]
    where = {}
    slot_cache: dict = {}
    for meta, g, i in layout.parameters():
        layer, tid = layout.groups[g]
        t = layout.templates[tid]
        slots = slot_cache.setdefault((tid, i), _slots(t, i))
        owners = set()
        for s in slots:
            hf_name = expand_name(t.hf[s][0], layer)
            k = stage_of.get(hf_name)
            if k is None:
                raise LayoutUnavailable(f"engine parameter {meta.name!r} is fed by {hf_name!r}, which the trainer "
                                        f"does not send")
            if stages[k][2][hf_name] != meta.dtype:
                raise LayoutUnavailable(f"{hf_name!r} is sent as {stages[k][2][hf_name]} but engine parameter "
                                        f"{meta.name!r} is {meta.dtype}")
            owners.add(k)
        if len(owners) > 1:
            raise LayoutUnavailable(f"engine parameter {meta.name!r} is fed by tensors of pipeline stages "
                                    f"{sorted(stages[k][0] for k in owners)}")
        per_stage[min(owners, default=0)].append(meta)
        where[meta.name] = (g, i)
    per_rank = max(1, int(bucket_bytes) // layout.tp_size - _ALIGN)
    send = SendPlan([StagePlan(pp, leader, metas, plan_buckets(metas, per_rank))
                     for (pp, leader, _), metas in zip(stages, per_stage) if metas], [])
    sent = sorted((n, str(d), stage_of[n]) for _, _, s in stages for n, d in s.items())
    key = hashlib.sha256(f"{layout.fingerprint}|{per_rank}|{sent}".encode()).hexdigest()[:20]
    expected = layout.tp_size * sum(m.numel for s in send.stages for m in s.metas)
    return DirectPlan(layout, send, where, key, expected, tuple(n for n, _, _ in sent))


def _joint_runs(shape, d_stride, d_off: int, s_stride, s_off: int) -> torch.Tensor:
    """``[N, 3]`` runs ``(dst, src, length)`` of an element-wise copy between two strided views of one ``shape``
    (dims coalesced where both sides are contiguous across them; the innermost dim is one run when both strides
    are 1)."""
    if any(n == 0 for n in shape):
        return torch.zeros((0, 3), dtype=torch.int64)
    dims: list[list[int]] = []
    for n, ds, ss in zip(shape, d_stride, s_stride):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * ds and dims[-1][2] == n * ss:
            dims[-1] = [dims[-1][0] * n, ds, ss]
        else:
            dims.append([n, ds, ss])
    length = dims.pop()[0] if dims and dims[-1][1] == 1 and dims[-1][2] == 1 else 1
    d = torch.tensor([d_off], dtype=torch.int64)
    s = torch.tensor([s_off], dtype=torch.int64)
    for n, ds, ss in dims:
        ar = torch.arange(n, dtype=torch.int64)
        d = (d[:, None] + ar * ds).reshape(-1)
        s = (s[:, None] + ar * ss).reshape(-1)
    return torch.stack([d, s, torch.full_like(d, length)], 1)


def shard_runs(role, shard_shape, hf_name: str, hf_shape, spec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """``[N, 3]`` runs ``(offset in the HF tensor, offset in the flat local shard, length)``, sorted, of the elements
    of ``hf_name`` this trainer rank's shard (contiguous, ``shard_shape``) fills: the converter's ``shard_regions``
    on meta tensors, read as strides."""
    runs = []
    for reg in shard_regions(role, torch.empty(tuple(shard_shape), device="meta"), spec, tp_rank, tp_size):
        if reg.name != hf_name:
            continue
        dst = torch.empty(tuple(hf_shape), device="meta").narrow(reg.dim, reg.start, reg.length)
        if dst.shape != reg.src.shape:
            dst = dst.view(reg.src.shape)
        runs.append(_joint_runs(tuple(reg.src.shape), dst.stride(), dst.storage_offset(), reg.src.stride(),
                                reg.src.storage_offset()))
    out = torch.cat(runs) if runs else torch.zeros((0, 3), dtype=torch.int64)
    return out[torch.argsort(out[:, 0])]


def _intersect(eruns: torch.Tensor, truns: torch.Tensor) -> tuple[list, list, list]:
    """Engine runs ``(dst, offset, length)`` into one HF tensor x this rank's runs ``(offset, local, length)`` of it
    -> the copies ``(dst, local, length)`` this rank makes, sorted by dst, contiguous pieces joined."""
    if eruns.shape[0] == 0 or truns.shape[0] == 0:
        return [], [], []
    e0, e1 = eruns[:, 1], eruns[:, 1] + eruns[:, 2]
    t0, t1 = truns[:, 0], truns[:, 0] + truns[:, 2]
    lo = torch.searchsorted(t1, e0, right=True)  # first rank run ending after the engine run starts
    hi = torch.searchsorted(t0, e1, right=False)  # first rank run starting at or after its end
    cnt = (hi - lo).clamp(min=0)
    if int(cnt.sum()) == 0:
        return [], [], []
    ei = torch.repeat_interleave(torch.arange(eruns.shape[0]), cnt)
    ti = lo[ei] + torch.arange(ei.numel()) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
    a, b = torch.maximum(e0[ei], t0[ti]), torch.minimum(e1[ei], t1[ti])
    keep = b > a
    ei, ti, a, b = ei[keep], ti[keep], a[keep], b[keep]
    dst = eruns[ei, 0] + (a - e0[ei])
    loc = truns[ti, 1] + (a - t0[ti])
    n = b - a
    order = torch.argsort(dst)
    dst, loc, n = dst[order], loc[order], n[order]
    if dst.numel() > 1:  # join pieces contiguous on both sides
        brk = torch.ones(dst.numel(), dtype=torch.bool)
        brk[1:] = ~((dst[1:] == dst[:-1] + n[:-1]) & (loc[1:] == loc[:-1] + n[:-1]))
        seg = torch.cumsum(brk.to(torch.int64), 0) - 1
        n = torch.zeros(int(seg[-1]) + 1, dtype=torch.int64).index_add_(0, seg, n)
        dst, loc = dst[brk], loc[brk]
    return dst.tolist(), loc.tolist(), n.tolist()


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


def compose_writes(plan: DirectPlan, entries, spec, tp_rank: int, tp_size: int, pp_rank: int = 0,
                   zeros: bool = True) -> tuple[list[list], int]:
    """This trainer rank's writes of every bucket of its pipeline stage and the number of elements they cover.

    Args:
        entries: this rank's LocalTensors (parallel.convert), whose shards are written.
        spec, tp_rank, tp_size, pp_rank: the model spec and this rank's trainer TP / PP position.
        zeros: TP rank 0 writes the zeros the engine's loaders write (padded vocabulary rows); False on an expert
            peer (expert parallelism: the stage's own TP rank 0 writes them).
    Returns:
        (ops, covered): ``ops[k]`` lists ``(engine rank, byte offset in the section, nbytes, dtype, entry index or
        -1 for zeros, blocks)`` of the stage's bucket k (blocks as in :func:`_merge_blocks`, in elements of the
        parameter and of the entry's flattened tensor); ``covered`` counts the engine elements written (zeros by
        TP rank 0 only).  The copies of a template's parameter are composed once and reused for every layer whose
        tensors come from shards of the same kind and shape.
    Raises:
        LayoutUnavailable: a shard is not contiguous.
    """
    stage = plan.stage(pp_rank)
    if stage is None:
        return [], 0
    layout = plan.layout
    owner = {}
    for i, e in enumerate(entries):
        for j, n in enumerate(e.role.hf_names):
            owner[n] = (i, j)
    shard_cache: dict = {}
    block_cache: dict = {}
    ops: list[list] = [[] for _ in stage.buckets]
    covered = 0
    for k, bucket in enumerate(stage.buckets):
        for meta, off in zip(bucket.metas, bucket.offsets):
            g, i = plan.where[meta.name]
            layer, tid = layout.groups[g]
            t = layout.templates[tid]
            for e in range(layout.tp_size):
                runs = t.runs[e][i]
                if tp_rank == 0 and zeros:
                    zkey = ("zeros", tid, e, i)
                    if zkey not in block_cache:
                        z = runs[runs[:, 1] == -1]
                        block_cache[zkey] = (_merge_blocks(z[:, 0].tolist(), [0] * z.shape[0], z[:, 3].tolist()),
                                             int(z[:, 3].sum()))
                    blocks, n = block_cache[zkey]
                    if blocks:
                        ops[k].append((e, off, meta.nbytes, meta.dtype, -1, blocks))
                        covered += n
                for s in runs[:, 1].unique().tolist():
                    if s < 0:
                        continue
                    rel, hf_shape = t.hf[s]
                    hf_name = expand_name(rel, layer)
                    if hf_name not in owner:
                        continue  # another trainer rank's (or nobody's: the coverage check catches it)
                    ent, j = owner[hf_name]
                    entry = entries[ent]
                    if not entry.tensor.is_contiguous():
                        raise LayoutUnavailable(f"{entry.local_name}: a non-contiguous shard cannot be written by "
                                                f"blocks")
                    skey = (entry.role.kind, j, tuple(entry.tensor.shape), tuple(hf_shape))
                    if skey not in shard_cache:
                        shard_cache[skey] = shard_runs(entry.role, entry.tensor.shape, entry.role.hf_names[j],
                                                       hf_shape, spec, tp_rank, tp_size)
                    bkey = (tid, e, i, s, skey)
                    if bkey not in block_cache:
                        sel = runs[runs[:, 1] == s]
                        d, src, n = _intersect(sel[:, [0, 2, 3]], shard_cache[skey])
                        block_cache[bkey] = (_merge_blocks(d, src, n), sum(n))
                    blocks, n = block_cache[bkey]
                    if blocks:
                        ops[k].append((e, off, meta.nbytes, meta.dtype, ent, blocks))
                        covered += n
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
