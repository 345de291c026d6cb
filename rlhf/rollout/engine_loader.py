"""Runs inside SGLang's scheduler processes: our custom weight loader (``custom_weight_loader`` server argument).

SGLang 0.5.23 calls ``loader(model, named_tensors)`` from ``update_weights_from_tensor`` when the request's
``load_format`` is an import path listed in the engine's ``custom_weight_loader``
(sglang/srt/model_executor/model_runner_components/weight_updater.py); :data:`LOADER` is that path and
rlhf.rollout.engine_args registers it for every engine.  ``named_tensors`` holds exactly one
``(header, tensor)``: the header is JSON naming the operation:

* ``probe`` -- derive where every element of every HF tensor lands in this rank's parameters by running the
  model's OWN ``load_weights`` on index tensors (rlhf.rollout.engine_probe.probe_layout: one decoder layer at a
  time, integer indices, layers of one shape checked against the first); the result goes to a file the Ray
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
* ``share`` -- move this rank's parameters into one shared-memory arena (CPU only; :func:`share_parameters`) and
  report its handle and every parameter's byte offset: the trainer ranks then write each sync's weights straight
  into the parameters (zero copy in the engine).
* ``commit`` -- after the trainer ranks wrote into the arena: check that every parameter still lives there; one
  that SGLang moved meanwhile gets the arena's bytes copied into it (:func:`commit_shared`).
* ``release`` -- drop the bucket mappings kept across syncs (:func:`keep_mapped`).
* ``dump`` -- every parameter of this rank to a file (diagnostics, tests).

Imports only torch and the standard library at module level (the scheduler imports it on each call).
"""
from __future__ import annotations

import base64
import json
import weakref
from typing import Iterable, Sequence

import torch

from rlhf.rollout.engine_probe import (LayoutProbeError, engine_params, layout_fingerprint, param_signature,
                                       probe_layout)

__all__ = ["LOADER", "LayoutProbeError", "engine_params", "param_signature", "probe_layout", "layout_fingerprint",
           "copy_bucket", "bucket_header", "load_bucket", "wait_for_devices", "keep_mapped", "share_parameters",
           "commit_shared", "load"]

#: the import path SGLang calls (``load_format`` of the update and an entry of ``custom_weight_loader``)
LOADER = "rlhf.rollout.engine_loader.load"

_HELD: dict = {}  # data_ptr -> mapped shared-memory storage of a trainer's bucket buffer, kept across syncs
_USED: set = set()  # data_ptrs loaded from since the last bucket of a sync


def keep_mapped(t: torch.Tensor, last: bool) -> None:
    """Keep the mapping of the shared-memory bucket ``t`` lives in until a sync ends without it.

    The trainer reuses the same bucket buffers every sync.  Dropped after each load, a buffer is mapped again by the
    next deserialization and every 4 KiB page faults again on the first read (measured: the engine's copy runs at
    a third of memcpy speed that way); held, torch's shared-storage cache hands back this mapping.  ``last``: the
    sync's last bucket -- buffers not loaded from during this sync are released (the trainer replaced them).
    CPU shared memory only (a CUDA IPC handle held here would pin the sender's memory).
    """
    st = t.untyped_storage()
    if t.device.type == "cpu" and st.is_shared():
        _HELD[st.data_ptr()] = st
        _USED.add(st.data_ptr())
    if last:
        for key in [k for k in _HELD if k not in _USED]:
            del _HELD[key]
        _USED.clear()


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


def bucket_header(payloads: Sequence, last: bool = False) -> str:
    """The ``bucket`` operation's JSON header for one bucket: ``payloads[r]`` is engine TP rank r's serialized
    ``{"flattened_tensor", "metadata"}`` (bytes, or SGLang's base64 string), carried base64-encoded; ``last``: the
    sync's last bucket (:func:`keep_mapped`)."""
    enc = [p if isinstance(p, str) else base64.b64encode(bytes(p)).decode("ascii") for p in payloads]
    return json.dumps({"op": "bucket", "payloads": enc, "last": bool(last)})


def load_bucket(model, payload, load_weights=None, last: bool = False) -> int:
    """Load one serialized FlattenedTensorBucket (``payload``: bytes or base64 string) with the model's own
    ``load_weights`` (SGLang's generic loading: TP slicing, fused q/k/v, ...), then wait for the devices of the
    bucket and of the parameters (:func:`wait_for_devices`), so no copy still reads the sender's memory when this
    returns; the bucket's mapping is kept for the next sync (:func:`keep_mapped`).  Returns the number of tensors
    loaded."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    obj = MultiprocessingSerializer.deserialize(payload)
    flat = obj["flattened_tensor"]
    named = FlattenedTensorBucket(flattened_tensor=flat, metadata=obj["metadata"]).reconstruct_tensors()
    (load_weights or model.load_weights)(named)
    wait_for_devices({flat.device} | {p.device for p in engine_params(model).values()})
    keep_mapped(flat, last)
    return len(named)


_ARENAS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (arena storage, {name: offset})


def share_parameters(model, params: dict) -> dict:
    """Move every parameter of ``params`` into one shared-memory arena (torch's file_system sharing: a file any
    process on this host can map), each a contiguous view at a 64-byte aligned offset; done once per model (again
    only after :func:`commit_shared` found a parameter moved).  Peak extra memory: the arena while the old
    storages are freed one by one (CPU).

    Returns ``{"manager", "handle", "size", "offsets": {name: byte offset}, "dtypes": {name: dtype name}}``
    (``manager``/``handle`` as latin-1 strings: torch's shared-memory manager socket and file name).
    Raises ValueError for a parameter not on the CPU (CUDA parameters would need IPC handles instead), or for a
    layer whose quantization method restores in-place-packed weights at a session's begin: the trainer ranks write
    before the commit's session opens, so that restore would run on the new weights.
    """
    held = _ARENAS.get(model)
    if held is None:
        devices = {p.device.type for p in params.values()}
        if devices != {"cpu"}:
            raise ValueError(f"zero-copy weight sync needs CPU parameters, the engine's are on {sorted(devices)}")
        restoring = sorted({type(m.quant_method).__name__ for m in model.modules() if _restores(m)})
        if restoring:
            raise ValueError(f"zero-copy weight sync: quantization method(s) {restoring} repack weights in place "
                             f"(restore_weights_before_loading); only SGLang's own loading handles them")
        offsets, size = {}, 0
        for name, p in params.items():
            offsets[name] = size
            size += -(-p.numel() * p.element_size() // 64) * 64
        storage = torch.UntypedStorage._new_using_filename_cpu(max(size, 1))
        arena = torch.empty(0, dtype=torch.uint8).set_(storage)
        with torch.no_grad():
            for name, p in params.items():
                view = arena[offsets[name]:offsets[name] + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
        held = _ARENAS[model] = (storage, offsets)
    storage, offsets = held
    manager, handle, size = storage._share_filename_cpu_()
    return {"manager": manager.decode("latin-1"), "handle": handle.decode("latin-1"), "size": int(size),
            "offsets": dict(offsets), "dtypes": {n: str(p.dtype).replace("torch.", "") for n, p in params.items()}}


def _restores(module) -> bool:
    """``module``'s quantization method may repack weights in place around a weight-update session (SGLang's
    ``restore_weights_before_loading`` at the begin, sglang/srt/model_loader/loader.py): every method but SGLang's
    unquantized ones, whose restore acts only for a GPU MoE backend (flashinfer TRT-LLM; the shared parameters here
    are on the CPU)."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return False
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
    from sglang.srt.layers.quantization.unquant import (UnquantizedEmbeddingMethod, UnquantizedFusedMoEMethod,
                                                        UnquantizedLinearMethod)

    unquantized = (UnquantizedEmbeddingMethod, UnquantizedFusedMoEMethod, UnquantizedLinearMethod)
    return (isinstance(method, QuantizeMethodBase) and not isinstance(method, unquantized)
            and type(method).restore_weights_before_loading is not QuantizeMethodBase.restore_weights_before_loading)


def commit_shared(model, params: dict) -> list[str]:
    """The trainer ranks wrote the new weights into the arena (:func:`share_parameters`): return the parameters
    that no longer live there (SGLang replaced their storage), after copying the arena's bytes into them -- the
    engine holds the new weights either way; the caller shares again before the next zero-copy sync."""
    held = _ARENAS.get(model)
    if held is None:
        raise ValueError(f"{LOADER}: commit without shared parameters (share first)")
    storage, offsets = held
    base, moved = storage.data_ptr(), []
    arena = torch.empty(0, dtype=torch.uint8).set_(storage)
    with torch.no_grad():
        for name, p in params.items():
            if p.data.data_ptr() != base + offsets[name] or not p.data.is_contiguous():
                n = p.numel() * p.element_size()
                p.data.copy_(arena[offsets[name]:offsets[name] + n].view(p.dtype).view(p.shape))
                moved.append(name)
    if moved:
        del _ARENAS[model]
    return moved


_SIGNATURES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (tp rank, size, signature)


def _signature(model, params: dict, rank: int, size: int) -> str:
    """:func:`param_signature`, computed once per model (the parameters' names, shapes and dtypes are fixed once
    the engine is built; a restarted engine is a new model)."""
    got = _SIGNATURES.get(model)
    if got is None or got[:2] != (rank, size):
        got = (rank, size, param_signature(params, rank, size))
        _SIGNATURES[model] = got
    return got[2]


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
        mine = _signature(model, params, rank, size)
        want = head["signatures"][rank] if rank < len(head["signatures"]) else None
        if want != mine:
            raise ValueError(f"{LOADER}: bucket laid out for parameter signature {want}, engine TP rank {rank} has "
                             f"{mine}: refused, nothing copied")
        copy_bucket(params, tensor, head["params"])
        keep_mapped(tensor, bool(head.get("last")))
    elif op == "bucket":
        payloads = head["payloads"]
        if rank >= len(payloads):
            raise ValueError(f"{LOADER}: bucket with {len(payloads)} payloads, engine TP rank {rank} has none")
        load_bucket(model, payloads[rank], last=bool(head.get("last")))
    elif op == "release":
        keep_mapped(torch.empty(0), True)
    elif op == "share":
        try:
            result = share_parameters(model, params)
        except Exception as e:  # noqa: BLE001 - reported to the actor, the scheduler lives on
            result = {"error": f"{type(e).__name__}: {e}"}
        result.update(tp_rank=rank, tp_size=size, signature=_signature(model, params, rank, size))
        torch.save(result, f"{head['out']}.rank{rank}.pt")
    elif op == "commit":  # a result file only when a parameter moved (the common case writes nothing)
        moved = commit_shared(model, params)
        if moved:
            torch.save({"moved": moved, "tp_rank": rank}, f"{head['out']}.rank{rank}.pt")
    elif op == "probe":
        try:
            result = probe_layout(model, head["hf"], rank, size)
        except Exception as e:  # noqa: BLE001 - reported to the actor, the scheduler lives on
            result = {"error": f"{type(e).__name__}: {e}", "tp_rank": rank, "tp_size": size}
        torch.save(result, f"{head['out']}.rank{rank}.pt")
    elif op == "dump":
        torch.save({n: p.detach().cpu().clone() for n, p in params.items()}, f"{head['out']}.rank{rank}.pt")
    else:
        raise ValueError(f"{LOADER}: unknown operation {op!r} (use 'load', 'bucket', 'probe', 'share', 'commit', "
                         f"'release' or 'dump')")
