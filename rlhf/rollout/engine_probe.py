"""Runs inside SGLang's scheduler processes: where every HF tensor element lands in this TP rank's parameters,
read off the model's OWN loaders (no second copy of SGLang's loading rules).

The probe hands the model's ``load_weights`` integer index tensors instead of weights and reads the parameters
back.  It is cheap in memory and time:

* one group at a time: the HF tensors and parameters of one decoder layer (``...layers.<i>....``), or everything
  outside the layers.  Only that group's parameters become real (CPU) tensors; every other parameter is a
  zero-memory sentinel (one element, expanded), so a loader that writes outside its group is caught (a copy into
  an expanded tensor raises, a fill changes the shared element) and no copy of the whole model is ever held (on
  GPU the weights stay where they are; nothing is allocated on the device);
* integer indices (int32, int64 when a group has 2^31 elements or more): exact, half the bytes of float64;
* one ``load_weights`` call per group (as SGLang's own loading passes many tensors per call);
* layers with the same shape signature (relative names, shapes, dtypes) reuse the first one's map only after a
  check: their probed values must equal the first layer's bitwise (indices are group-relative, so equal values
  mean equal maps); a layer that differs gets its own map;
* a second pass with reversed indices on each map's first layer proves the loaders only copy (a scaled or
  shifted value decodes differently).

Imports only torch and the standard library (the scheduler imports this module on each loader call).
"""
from __future__ import annotations

import hashlib
import math
import re
import weakref
from typing import Sequence

import torch

__all__ = ["LayoutProbeError", "engine_params", "param_signature", "split_layer", "expand_name", "probe_layout",
           "layout_fingerprint"]

_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {name: Parameter}
_LAYER = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
_MARK = "{L}"  # the layer index in a template name
_BATCH = 1 << 26  # HF index elements handed to one load_weights call (a larger tensor goes alone)
_CHUNK = 1 << 20  # elements compared at once (bounded temporaries)


class LayoutProbeError(RuntimeError):
    """The engine's loaders do something a copy cannot reproduce (values changed, part of a parameter left
    untouched, a write outside the tensor's layer); the message names the parameter."""


def engine_params(model) -> dict:
    """``{name: Parameter}`` of ``model`` (``named_parameters``: a tied weight appears once), cached per model."""
    params = _PARAMS.get(model)
    if params is None:
        params = dict(model.named_parameters())
        _PARAMS[model] = params
    return params


def param_signature(params: dict, tp_rank: int, tp_size: int) -> str:
    """Hex digest of the parameters a bucket is laid out for: TP rank and size, every name, shape, dtype."""
    h = hashlib.sha256(f"{tp_size}:{tp_rank};".encode())
    for name, p in params.items():
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{p.is_contiguous()};".encode())
    return h.hexdigest()[:20]


def split_layer(name: str) -> tuple[int | None, str]:
    """``("model.layers.7.mlp.up_proj.weight")`` -> ``(7, "model.layers.{L}.mlp.up_proj.weight")``; a name outside
    the decoder layers -> ``(None, name)``."""
    m = _LAYER.match(name)
    return (None, name) if m is None else (int(m.group(2)), f"{m.group(1)}{_MARK}{m.group(3)}")


def expand_name(template: str, layer: int | None) -> str:
    """Inverse of :func:`split_layer`."""
    return template if layer is None else template.replace(_MARK, str(layer), 1)


def _element_runs(values: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Starts (shifted by ``offset``) and codes of the maximal runs of flat ``values`` (1 + index, 0 = zeros): an
    index run continues while the index grows by one, a zero run while zeros follow."""
    code = values.to(torch.int64) - 1  # -1: zeros
    brk = torch.ones(code.numel(), dtype=torch.bool)
    if code.numel() > 1:
        a, b = code[:-1], code[1:]
        brk[1:] = ~(((a >= 0) & (b == a + 1)) | ((a < 0) & (b < 0)))
    idx = brk.nonzero().squeeze(1)
    return idx + offset, code[idx]


def _runs(values: torch.Tensor, shape: tuple, bases: torch.Tensor) -> torch.Tensor:
    """``[R, 4]`` int64 runs ``(dst start, HF slot or -1 for zeros, offset in that HF tensor, length)`` of one
    probed parameter (flat integer ``values`` of ``shape``: 0 zero-filled, else 1 + group-relative index, none
    untouched; ``bases[s]``: first group-relative index of slot s).

    Row by row first (the last dim): a row that is one ascending index run or all zeros costs two passes; only
    the other rows (a row split between HF tensors or TP shards) are decoded element by element."""
    n = values.numel()
    cols = int(shape[-1]) if len(shape) and int(shape[-1]) > 0 else max(n, 1)
    v = values.view(-1, cols)
    first = v[:, 0]
    ar = torch.arange(cols, dtype=v.dtype)
    step = max(1, _CHUNK // cols)
    whole = torch.cat([(v[a:a + step] == first[a:a + step, None] + ar).all(1) for a in range(0, v.shape[0], step)])
    whole &= first >= 1
    rest = (~whole).nonzero().squeeze(1)
    zero = torch.zeros(0, dtype=torch.long)
    if rest.numel():
        zero = rest[(v[rest] == 0).all(1)]
        rest = rest[~(v[rest] == 0).all(1)]
    starts = [whole.nonzero().squeeze(1) * cols, zero * cols]
    codes = [first[whole].to(torch.int64) - 1, torch.full((zero.numel(),), -1, dtype=torch.int64)]
    for r in rest.tolist():  # rows that are not one run: element by element
        st, c = _element_runs(v[r], r * cols)
        starts.append(st)
        codes.append(c)
    start = torch.cat(starts)
    code = torch.cat(codes)
    order = torch.argsort(start)
    start, code = start[order], code[order]
    if start.numel() > 1:  # join runs that continue across rows
        length0 = torch.diff(start, append=torch.tensor([n]))
        cont = torch.zeros(start.numel(), dtype=torch.bool)
        a, b = code[:-1], code[1:]
        cont[1:] = ((a >= 0) & (b == a + length0[:-1])) | ((a < 0) & (b < 0))
        start, code = start[~cont], code[~cont]
    length = torch.diff(start, append=torch.tensor([n]))
    # a run never crosses into the next HF tensor: split runs at the slot bases they contain
    first_slot = torch.searchsorted(bases, code, right=True) - 1
    last_slot = torch.searchsorted(bases, code + length - 1, right=True) - 1
    crossing = (code >= 0) & (last_slot > first_slot)
    if bool(crossing.any()):
        rows = []
        for i in crossing.nonzero().squeeze(1).tolist():
            st, c, ln = int(start[i]), int(code[i]), int(length[i])
            for b in bases[int(first_slot[i]) + 1:int(last_slot[i]) + 1].tolist() + [c + ln]:
                rows.append((st, c, b - c))
                st, c = st + b - c, b
        extra = torch.tensor(rows, dtype=torch.int64)
        keep = ~crossing
        start, code, length = (torch.cat([start[keep], extra[:, 0]]), torch.cat([code[keep], extra[:, 1]]),
                               torch.cat([length[keep], extra[:, 2]]))
        order = torch.argsort(start)
        start, code, length = start[order], code[order], length[order]
    slot = torch.where(code >= 0, torch.searchsorted(bases, code, right=True) - 1, torch.full_like(code, -1))
    off = torch.where(code >= 0, code - bases[slot.clamp(min=0)], torch.zeros_like(code))
    return torch.stack([start, slot, off, length], 1)


def _signature(hf: list, params: list) -> tuple:
    return (tuple((rel, tuple(shape)) for rel, _, shape in hf),
            tuple((rel, tuple(p.shape), dtype) for rel, _, p, dtype in params))


def probe_layout(model, hf_tensors: Sequence[tuple[str, Sequence[int]]], tp_rank: int, tp_size: int,
                 load_weights=None) -> dict:
    """Where every HF tensor element lands in ``model``'s parameters (see module docstring).

    Args:
        model: the SGLang model (or any module with ``load_weights(iterable of (name, tensor))``).
        hf_tensors: ``[(HF name, full shape)]`` the engine accepts.
        tp_rank, tp_size: this rank (recorded in the result and its signature).
        load_weights: override of ``model.load_weights`` (tests).
    Returns:
        ``{"tp_rank", "tp_size", "signature", "templates": [{"hf": [(relative HF name, shape)], "params":
        [(relative name, shape, dtype name, runs [R, 4] int64)]}], "groups": [(layer or None, template)]}``.
        Relative names carry ``{L}`` for the layer index (:func:`expand_name`); runs are ``(dst start in the flat
        parameter, slot in the template's ``hf`` list or -1 for zeros written by the loader, offset in that HF
        tensor, length)``.  A parameter no HF tensor reaches is left out (it keeps its value, as with SGLang's
        own loading).  Peak extra memory: one group's parameters and HF tensors as integers (CPU).
    Raises:
        LayoutProbeError: a loader changes values, writes only part of a parameter, or writes outside its group;
            the model derives tensors after loading (``post_load_weights``).
    """
    if callable(getattr(model, "post_load_weights", None)):
        # SGLang's DeepSeek-V2/V3 (MLA) and others derive tensors from the loaded ones after loading (the absorbed
        # w_kc / w_vc from kv_b_proj): a plain copy into the parameters would leave those stale
        raise LayoutProbeError(f"{type(model).__name__} derives tensors after loading (post_load_weights): only "
                               f"SGLang's own load_weights keeps them in step")
    load_weights = load_weights or model.load_weights
    params = engine_params(model)
    groups: dict = {}
    for name, shape in hf_tensors:
        key, rel = split_layer(name)
        groups.setdefault(key, ([], []))[0].append((rel, name, tuple(int(s) for s in shape)))
    for name, p in params.items():
        key, rel = split_layer(name)
        groups.setdefault(key, ([], []))[1].append((rel, name, p, str(p.dtype).replace("torch.", "")))
    keys = sorted(groups, key=lambda k: -1 if k is None else k)
    for k in keys:
        groups[k][0].sort()
        groups[k][1].sort(key=lambda t: t[0])
    sigs = {k: _signature(*groups[k]) for k in keys}  # before any parameter's data is replaced
    counts: dict = {}
    for sig in sigs.values():
        counts[sig] = counts.get(sig, 0) + 1
    saved = {n: (p.data, p.requires_grad) for n, p in params.items()}  # integer data needs requires_grad off
    sentinel = torch.full((), -1, dtype=torch.int32)  # every other parameter: this element, expanded
    scratch = _Scratch()
    templates: list[dict] = []
    by_sig: dict = {}  # signature -> [(template index, probed values per parameter or None)]
    out_groups = []
    try:
        for p in params.values():
            p.requires_grad_(False)
            p.data = sentinel.expand(tuple(p.shape))
        for k in keys:
            hf, plist = groups[k]
            if not hf:
                continue  # parameters no HF tensor reaches keep their values
            sig = sigs[k]
            fwd = _probe_group(load_weights, hf, plist, sentinel, scratch, reverse=False)
            tid = next((t for t, vals in by_sig.get(sig, ()) if vals is not None and
                        all(torch.equal(a, b) for a, b in zip(vals, fwd))), None)
            if tid is None:
                tid = len(templates)
                templates.append(_template(load_weights, hf, plist, sentinel, scratch, fwd))
                by_sig.setdefault(sig, []).append((tid, [f.clone() for f in fwd] if counts[sig] > 1 else None))
            out_groups.append((k, tid))
            for _, _, p, _ in plist:
                p.data = sentinel.expand(tuple(p.shape))
    finally:
        for n, p in params.items():
            p.data = saved[n][0]
            p.requires_grad_(saved[n][1])
    return {"tp_rank": int(tp_rank), "tp_size": int(tp_size), "signature": param_signature(params, tp_rank, tp_size),
            "templates": templates, "groups": out_groups}


def _index_dtype(total: int) -> torch.dtype:
    return torch.int32 if total + 1 < 2 ** 31 else torch.int64


class _Scratch:
    """Buffers every group reuses: memory fresh from the OS costs a page fault per 4 KiB on first touch, which
    dominated the probe when each group allocated its own."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, key: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get((key, dtype))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(key, dtype)] = torch.empty(max(n, 1), dtype=dtype)
        return buf[:n]


def _probe_group(load_weights, hf: list, plist: list, sentinel: torch.Tensor, scratch: _Scratch,
                 reverse: bool) -> list:
    """The group's HF tensors as indices through ``load_weights`` (one call, or batches of at most ``_BATCH``
    elements); the group's parameters' values (flat views of a scratch buffer)."""
    total = sum(math.prod(shape) for _, _, shape in hf)
    dt = _index_dtype(total)
    pbuf = scratch.get("reversed" if reverse else "forward", sum(p.numel() for _, _, p, _ in plist), dt)
    pbuf.fill_(-1)
    off = 0
    for _, _, p, _ in plist:
        p.data = pbuf[off:off + p.numel()].view(tuple(p.shape))
        off += p.numel()
    ibuf = scratch.get("inputs", min(total, max(_BATCH, max(math.prod(s) for _, _, s in hf))), dt)
    batch, used, base = [], 0, 0
    for _, name, shape in hf:
        n = math.prod(shape)
        if batch and used + n > ibuf.numel():
            load_weights(batch)
            batch, used = [], 0
        dst = ibuf[used:used + n]
        if reverse:
            torch.arange(total - base, total - base - n, -1, dtype=dt, out=dst)
        else:
            torch.arange(base + 1, base + n + 1, dtype=dt, out=dst)
        batch.append((name, dst.view(shape)))
        used, base = used + n, base + n
    if batch:
        load_weights(batch)
    del batch
    if int(sentinel) != -1:
        raise LayoutProbeError(f"loading {[n for _, n, _ in hf][:3]}... wrote into a parameter of another layer")
    return [p.data.reshape(-1) for _, _, p, _ in plist]


def _template(load_weights, hf: list, plist: list, sentinel: torch.Tensor, scratch: _Scratch, fwd: list) -> dict:
    """A new map from the group's forward values, proven a copy by the reversed pass."""
    total = sum(math.prod(shape) for _, _, shape in hf)
    rev = _probe_group(load_weights, hf, plist, sentinel, scratch, reverse=True)
    bases = torch.tensor([0] + [math.prod(s) for _, _, s in hf], dtype=torch.int64).cumsum(0)[:-1]
    out = []
    for (rel, name, p, dtype), f, r in zip(plist, fwd, rev):
        lo, hi = (int(x) for x in f.aminmax())
        if lo == hi == -1:
            continue  # no HF tensor reaches it
        if lo == -1:
            raise LayoutProbeError(f"parameter {name!r}: the engine's loaders write only part of it")
        if lo < 0 or hi > total:
            raise LayoutProbeError(f"parameter {name!r}: the engine's loader changes values (not a plain copy)")
        for a in range(0, f.numel(), _CHUNK):  # a copy puts index i at one place in both passes: i + 1, total - i
            fc, rc = f[a:a + _CHUNK], r[a:a + _CHUNK]
            odd = ((fc + rc) != total + 1).nonzero().squeeze(1)  # zeros written by the loader stay 0 in both
            if odd.numel() and not (bool((fc[odd] == 0).all()) and bool((rc[odd] == 0).all())):
                raise LayoutProbeError(f"parameter {name!r}: the engine's loader changes values (not a plain copy)")
        out.append((rel, tuple(p.shape), dtype, _runs(f, tuple(p.shape), bases)))
    return {"hf": [(rel, shape) for rel, _, shape in hf], "params": out}


def layout_fingerprint(ranks: list[dict]) -> str:
    """Digest of every rank's parameter signature, maps and groups (what a bucket laid out for them relies on)."""
    h = hashlib.sha256()
    for r in ranks:
        h.update(f"{r['tp_rank']}/{r['tp_size']}:{r['signature']};{r['groups']};".encode())
        for t in r["templates"]:
            h.update(repr(t["hf"]).encode())
            for name, shape, dtype, runs in t["params"]:
                h.update(f"{name}{tuple(shape)}{dtype}".encode())
                h.update(runs.contiguous().numpy().tobytes())
    return h.hexdigest()[:20]
