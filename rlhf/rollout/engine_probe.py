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
_CHUNK = 1 << 24  # elements decoded at once


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


def _runs(values: torch.Tensor, bases: torch.Tensor, name: str) -> torch.Tensor:
    """``[R, 4]`` int64 runs ``(dst start, HF slot or -1 for zeros, offset in that HF tensor, length)`` of one
    probed parameter (flat integer ``values``: -1 untouched, 0 zero-filled, else 1 + group-relative index;
    ``bases[s]``: first group-relative index of slot s).  Raises LayoutProbeError when part of it is untouched."""
    starts, codes = [], []
    prev = None  # (last code, was it a zero) of the previous chunk
    n = values.numel()
    for lo in range(0, n, _CHUNK):
        v = values[lo:lo + _CHUNK].to(torch.int64)
        if bool((v < 0).any()):
            raise LayoutProbeError(f"parameter {name!r}: the engine's loaders write only part of it")
        code = v - 1  # -1: zeros
        brk = torch.ones(code.numel(), dtype=torch.bool)
        if code.numel() > 1:
            a, b = code[:-1], code[1:]
            brk[1:] = ~(((a >= 0) & (b == a + 1)) | ((a < 0) & (b < 0)))
        if prev is not None:
            brk[0] = not ((prev >= 0 and int(code[0]) == prev + 1) or (prev < 0 and int(code[0]) < 0))
        idx = brk.nonzero().squeeze(1)
        starts.append(idx + lo)
        codes.append(code[idx])
        prev = int(code[-1])
    start = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64)
    code = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.int64)
    length = torch.diff(start, append=torch.tensor([n]))
    # a run never crosses into the next HF tensor: split runs at the slot bases they contain
    cuts = [start, code, length]
    first = torch.searchsorted(bases, code, right=True) - 1
    last = torch.searchsorted(bases, code + length - 1, right=True) - 1
    crossing = (code >= 0) & (last > first)
    if bool(crossing.any()):
        rows = []
        for i in crossing.nonzero().squeeze(1).tolist():
            s, c, ln = int(start[i]), int(code[i]), int(length[i])
            for b in bases[int(first[i]) + 1:int(last[i]) + 1].tolist() + [c + ln]:
                rows.append((s, c, b - c))
                s, c = s + b - c, b
        keep = ~crossing
        extra = torch.tensor(rows, dtype=torch.int64)
        cuts = [torch.cat([cuts[0][keep], extra[:, 0]]), torch.cat([cuts[1][keep], extra[:, 1]]),
                torch.cat([cuts[2][keep], extra[:, 2]])]
        order = torch.argsort(cuts[0])
        cuts = [c[order] for c in cuts]
    start, code, length = cuts
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
        LayoutProbeError: a loader changes values, writes only part of a parameter, or writes outside its group.
    """
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
            fwd = _probe_group(load_weights, hf, plist, sentinel, reverse=False)
            tid = next((t for t, vals in by_sig.get(sig, ()) if vals is not None and
                        all(torch.equal(a, b) for a, b in zip(vals, fwd))), None)
            if tid is None:
                tid = len(templates)
                templates.append(_template(load_weights, hf, plist, sentinel, fwd))
                by_sig.setdefault(sig, []).append((tid, fwd if counts[sig] > 1 else None))
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


def _probe_group(load_weights, hf: list, plist: list, sentinel: torch.Tensor, reverse: bool) -> list:
    """One ``load_weights`` call with the group's HF tensors as indices; the group's parameters' values (flat)."""
    total = sum(math.prod(shape) for _, _, shape in hf)
    dt = _index_dtype(total)
    for _, _, p, _ in plist:
        p.data = torch.full(tuple(p.shape), -1, dtype=dt)
    inputs, base = [], 0
    for _, name, shape in hf:
        n = math.prod(shape)
        vals = (torch.arange(total - base, total - base - n, -1, dtype=dt) if reverse
                else torch.arange(base + 1, base + n + 1, dtype=dt))
        inputs.append((name, vals.view(shape)))
        base += n
    load_weights(inputs)
    del inputs
    if int(sentinel) != -1:
        raise LayoutProbeError(f"loading {[n for _, n, _ in hf][:3]}... wrote into a parameter of another layer")
    return [p.data.reshape(-1) for _, _, p, _ in plist]


def _template(load_weights, hf: list, plist: list, sentinel: torch.Tensor, fwd: list) -> dict:
    """A new map from the group's forward values, proven a copy by the reversed pass."""
    total = sum(math.prod(shape) for _, _, shape in hf)
    rev = _probe_group(load_weights, hf, plist, sentinel, reverse=True)
    bases = torch.tensor([0] + [math.prod(s) for _, _, s in hf], dtype=torch.int64).cumsum(0)[:-1]
    out = []
    for (rel, name, p, dtype), f, r in zip(plist, fwd, rev):
        if not torch.equal(torch.where(f >= 1, total + 1 - f, f), r):
            raise LayoutProbeError(f"parameter {name!r}: the engine's loader changes values (not a plain copy)")
        if bool((f == -1).all()):
            continue  # no HF tensor reaches it
        if bool(((f < -1) | (f > total)).any()):
            raise LayoutProbeError(f"parameter {name!r}: the engine's loader changes values (not a plain copy)")
        out.append((rel, tuple(p.shape), dtype, _runs(f, bases, name)))
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
