"""Runs inside SGLang's scheduler processes: our custom weight loader (``custom_weight_loader`` server argument).

SGLang 0.5.23 calls ``loader(model, named_tensors)`` from ``update_weights_from_tensor`` when the request's
``load_format`` is an import path listed in the engine's ``custom_weight_loader``
(sglang/srt/model_executor/model_runner_components/weight_updater.py); :data:`LOADER` is that path and
rlhf.rollout.engine_args registers it for every engine.  ``named_tensors`` holds exactly one
``(header, tensor)``: the header is JSON naming the operation:

* ``probe`` -- derive where every element of every HF tensor lands in this rank's parameters by running the
  model's OWN ``load_weights`` on index tensors (:func:`probe_layout`); the result goes to a file the Ray
  actor reads (the scheduler has no other way to return data).  The weights are restored afterwards.
* ``load`` -- a bucket already in this rank's parameter layout (fused q/k/v, merged gate/up, padded vocabulary,
  sharded by engine TP rank): one contiguous copy per parameter (:func:`copy_bucket`), refused when the
  bucket was laid out for other parameters (:func:`param_signature`).
* ``bucket`` -- SGLang's generic loading of one ``FlattenedTensorBucket`` (the colocated weight sync's default
  path): this rank deserializes ITS payload from the header, runs the model's own ``load_weights`` on the bucket's
  tensors and waits for its devices (:func:`load_bucket`).  SGLang's ``load_format="flattened_bucket"`` does the
  same without the wait: its copies are queued on the device and the engine replies while they may still read the
  sender's buffer, which the sender then reuses for the next bucket.  Through this op the reply (SGLang answers
  after a barrier of its TP ranks, i.e. after every rank's loader returned) means every copy is done.
* ``dump`` -- every parameter of this rank to a file (diagnostics, tests).

Imports only torch and the standard library at module level (the scheduler imports it on each call).
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import weakref
from typing import Iterable, Sequence

import torch

__all__ = ["LOADER", "LayoutProbeError", "engine_params", "param_signature", "probe_layout", "layout_fingerprint",
           "copy_bucket", "bucket_header", "load_bucket", "wait_for_devices", "load"]

#: the import path SGLang calls (``load_format`` of the update and an entry of ``custom_weight_loader``)
LOADER = "rlhf.rollout.engine_loader.load"

_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {name: Parameter}


class LayoutProbeError(RuntimeError):
    """The engine's loaders do something a copy cannot reproduce (values changed, part of a parameter left
    untouched); the message names the parameter."""


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


def _runs(values: torch.Tensor, bases: torch.Tensor, total: int, reverse: bool, name: str) -> torch.Tensor:
    """``[R, 3]`` int64 runs ``(dst start, global HF index or -1 for zeros or -2 for untouched, length)`` of one
    probed parameter (flat float64 ``values``: -1 untouched, 0 zero-filled, else the encoded index)."""
    if not bool(torch.all(values == values.round())):
        raise LayoutProbeError(f"parameter {name!r}: the engine's loader changes values (not a plain copy)")
    v = values.to(torch.int64)
    code = torch.where(v >= 1, (total - v) if reverse else (v - 1), torch.where(v == 0, -1, -2))
    if bool(((v < -1) | (code >= total)).any()):
        raise LayoutProbeError(f"parameter {name!r}: the engine's loader changes values (not a plain copy)")
    n = code.numel()
    brk = torch.ones(n, dtype=torch.bool)
    if n > 1:
        prev, cur = code[:-1], code[1:]
        cont = ((prev >= 0) & (cur == prev + 1)) | ((prev < 0) & (cur == prev))
        brk[1:] = ~cont | torch.isin(cur, bases)  # a run never crosses into the next HF tensor
    starts = brk.nonzero().squeeze(1)
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return torch.stack([starts, code[starts], lengths], 1)


def probe_layout(model, hf_tensors: Sequence[tuple[str, Sequence[int]]], tp_rank: int, tp_size: int,
                 load_weights=None) -> dict:
    """Where every HF tensor element lands in ``model``'s parameters, read off the model's own loaders.

    Every parameter is temporarily replaced by a float64 tensor of -1; each HF tensor (in order, one
    ``load_weights`` call each) is passed as float64 values encoding its elements' global positions (exact up
    to 2^53 elements); the parameters are read back and compressed into runs; a second pass with the positions
    reversed proves the loaders only copy (a scaled or shifted value decodes differently).  The original
    parameter data is restored in all cases.  Peak extra memory: float64 copies of the parameters plus one
    HF tensor.

    Args:
        model: the SGLang model (or any module with ``load_weights(iterable of (name, tensor))``).
        hf_tensors: ``[(HF name, full shape)]`` the engine accepts.
        tp_rank, tp_size: this rank (recorded in the result and its signature).
        load_weights: override of ``model.load_weights`` (tests).
    Returns:
        ``{"tp_rank", "tp_size", "signature", "hf": [(name, shape, base)], "total", "params": [(name, shape,
        dtype name, runs [R, 3] int64)]}``; a parameter no HF tensor reaches is left out.  Run sources are global
        indices (``base`` of the HF tensor + flat position), -1 for zeros written by the loader.
    Raises:
        LayoutProbeError: a loader changes values, or leaves part of a parameter it writes untouched.
    """
    load_weights = load_weights or model.load_weights
    params = engine_params(model)
    hf, base = [], 0
    for name, shape in hf_tensors:
        hf.append((name, tuple(int(s) for s in shape), base))
        base += math.prod(int(s) for s in shape)
    total = base
    bases = torch.tensor([b for _, _, b in hf], dtype=torch.int64)
    saved = {n: p.data for n, p in params.items()}
    runs: list[dict] = []
    try:
        for reverse in (False, True):
            for p in params.values():
                p.data = torch.full(tuple(p.shape), -1.0, dtype=torch.float64, device=p.device)
            for name, shape, b in hf:
                idx = torch.arange(math.prod(shape), dtype=torch.float64)
                vals = (float(total - b) - idx) if reverse else (idx + float(b + 1))
                load_weights([(name, vals.view(shape))])
                del idx, vals
            runs.append({n: _runs(p.data.detach().reshape(-1).cpu(), bases, total, reverse, n)
                         for n, p in params.items()})
    finally:
        for n, p in params.items():
            p.data = saved[n]
    out = []
    for n, p in params.items():
        fwd, rev = runs[0][n], runs[1][n]
        if not torch.equal(fwd, rev):
            raise LayoutProbeError(f"parameter {n!r}: the engine's loader changes values (not a plain copy)")
        untouched = fwd[:, 1] == -2
        if bool(untouched.all()):
            continue  # no HF tensor reaches it: not sent, keeps its value (as with SGLang's own loading)
        if bool(untouched.any()):
            raise LayoutProbeError(f"parameter {n!r} {tuple(p.shape)}: the engine's loaders write only part of it")
        out.append((n, tuple(p.shape), str(p.dtype).replace("torch.", ""), fwd))
    return {"tp_rank": int(tp_rank), "tp_size": int(tp_size), "signature": param_signature(params, tp_rank, tp_size),
            "hf": hf, "total": total, "params": out}


def layout_fingerprint(ranks: list[dict]) -> str:
    """Digest of every rank's parameter signature and runs (what a bucket laid out for them relies on)."""
    h = hashlib.sha256()
    for r in ranks:
        h.update(f"{r['tp_rank']}/{r['tp_size']}:{r['signature']};".encode())
        for name, shape, dtype, runs in r["params"]:
            h.update(f"{name}{tuple(shape)}{dtype}".encode())
            h.update(runs.contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def copy_bucket(params: dict, flat: torch.Tensor, regions: Iterable[tuple[str, int]]) -> int:
    """Copy each ``(parameter name, byte offset)`` region of the flat uint8 ``flat`` into its parameter (one
    contiguous copy each, the parameter's own shape and dtype), then wait for CUDA devices so the sender may
    reuse its buffer.  Returns the bytes copied.  Raises KeyError for an unknown name, ValueError for a region
    past the end of ``flat``."""
    devices, done = set(), 0
    with torch.no_grad():
        for name, off in regions:
            p = params[name]
            nbytes = p.numel() * p.element_size()
            if off < 0 or off + nbytes > flat.numel():
                raise ValueError(f"parameter {name!r}: bytes {off}..{off + nbytes} lie outside the bucket "
                                 f"({flat.numel()} bytes)")
            p.data.copy_(flat[off:off + nbytes].view(p.dtype).view(p.shape))
            devices.add(p.device)
            done += nbytes
    wait_for_devices(devices | {flat.device})
    return done


def wait_for_devices(devices: Iterable[torch.device]) -> None:
    """Block until every kernel queued on each of ``devices`` (all streams) finished: device copies are
    asynchronous, and the sender reuses its buffer once the engine replied.  ``torch.<type>.synchronize`` of each
    device's own module (a no-op on the CPU, whose copies are done when they return)."""
    for dev in {torch.device(d) for d in devices}:
        torch.get_device_module(dev).synchronize(dev)


def bucket_header(payloads: Sequence) -> str:
    """The ``bucket`` operation's JSON header for one bucket: ``payloads[r]`` is engine TP rank r's serialized
    ``{"flattened_tensor", "metadata"}`` (bytes, or SGLang's base64 string), carried base64-encoded."""
    enc = [p if isinstance(p, str) else base64.b64encode(bytes(p)).decode("ascii") for p in payloads]
    return json.dumps({"op": "bucket", "payloads": enc})


def load_bucket(model, payload, load_weights=None) -> int:
    """Load one serialized FlattenedTensorBucket (``payload``: bytes or base64 string) with the model's own
    ``load_weights`` (SGLang's generic loading: TP slicing, fused q/k/v, ...), then wait for the devices of the
    bucket and of the parameters (:func:`wait_for_devices`), so no copy still reads the sender's memory when this
    returns.  Returns the number of tensors loaded."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    obj = MultiprocessingSerializer.deserialize(payload)
    flat = obj["flattened_tensor"]
    named = FlattenedTensorBucket(flattened_tensor=flat, metadata=obj["metadata"]).reconstruct_tensors()
    (load_weights or model.load_weights)(named)
    wait_for_devices({flat.device} | {p.device for p in engine_params(model).values()})
    return len(named)


def _tp() -> tuple[int, int]:
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return int(par.tp_rank), int(par.tp_size)


def load(model, named_tensors) -> None:
    """The custom loader SGLang calls (see module docstring).

    Raises:
        ValueError: not exactly one ``(header, tensor)``, an unknown operation, or a ``load`` bucket laid out
            for other parameters than this rank's (nothing is copied then).
    """
    named_tensors = list(named_tensors)
    if len(named_tensors) != 1:
        raise ValueError(f"{LOADER}: expected one (header, tensor), got {len(named_tensors)} entries")
    header, tensor = named_tensors[0]
    head = json.loads(header)
    rank, size = _tp()
    params = engine_params(model)
    op = head.get("op")
    if op == "load":
        mine = param_signature(params, rank, size)
        want = head["signatures"][rank] if rank < len(head["signatures"]) else None
        if want != mine:
            raise ValueError(f"{LOADER}: bucket laid out for parameter signature {want}, engine TP rank {rank} has "
                             f"{mine}: refused, nothing copied")
        copy_bucket(params, tensor, head["params"])
    elif op == "bucket":
        payloads = head["payloads"]
        if rank >= len(payloads):
            raise ValueError(f"{LOADER}: bucket with {len(payloads)} payloads, engine TP rank {rank} has none")
        load_bucket(model, payloads[rank])
    elif op == "probe":
        try:
            result = probe_layout(model, head["hf"], rank, size)
        except Exception as e:  # noqa: BLE001 - reported to the actor, the scheduler lives on
            result = {"error": f"{type(e).__name__}: {e}", "tp_rank": rank, "tp_size": size}
        torch.save(result, f"{head['out']}.rank{rank}.pt")
    elif op == "dump":
        torch.save({n: p.detach().cpu().clone() for n, p in params.items()}, f"{head['out']}.rank{rank}.pt")
    else:
        raise ValueError(f"{LOADER}: unknown operation {op!r} (use 'load', 'bucket', 'probe' or 'dump')")
