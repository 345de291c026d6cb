"""Runs inside SGLang's scheduler processes: our custom weight loader (``custom_weight_loader`` server argument).

SGLang 0.5.23 calls ``loader(model, named_tensors)`` from ``update_weights_from_tensor`` when the request's
``load_format`` is an import path listed in ``custom_weight_loader`` (model_runner_components/weight_updater.py);
:data:`LOADER` is ours (rlhf.rollout.engine_args).  ``named_tensors`` is one ``(JSON header, tensor)``; operations:
``bucket``, the colocated sync's load of one bucket (:func:`load_bucket`; docs/gpu.md D3), and ``dump``, every
parameter of this rank to a file (tests).  Imports only torch and the standard library at module level (the
scheduler imports it on each call).
"""
from __future__ import annotations

import base64
import json
from typing import Sequence

import torch

__all__ = ["LOADER", "bucket_header", "load_bucket", "keep_mapped", "load"]

#: the import path SGLang calls (``load_format`` of the update and an entry of ``custom_weight_loader``)
LOADER = "rlhf.rollout.engine_loader.load"

_HELD: dict = {}  # data_ptr -> mapped shared-memory storage of a trainer's bucket buffer, kept across syncs
_USED: dict = {}  # the same, of the buckets loaded since the last bucket of a sync


def keep_mapped(t: torch.Tensor, last: bool) -> None:
    """Keep the mapping of the shared-memory bucket ``t`` until a sync (``last``: its last bucket) ends without it:
    the trainer reuses its CPU buffers every sync, and a buffer mapped again faults in every 4 KiB page on the first
    read (the engine's copy ran at a third of memcpy speed so).  A no-op for CUDA tensors (a held IPC handle would
    pin the sender's memory; GPU buffers are freed after each sync)."""
    global _HELD, _USED
    st = t.untyped_storage()
    if t.device.type == "cpu" and st.is_shared():
        _USED[st.data_ptr()] = st
    if last:  # keep exactly this sync's
        _HELD, _USED = _USED, {}


def bucket_header(payloads: Sequence, last: bool = False) -> str:
    """The ``bucket`` header: ``payloads[r]``, engine TP rank r's serialized ``{"flattened_tensor", "metadata"}``
    (bytes, or SGLang's base64 string), base64-encoded; ``last``: the sync's last bucket."""
    enc = [p if isinstance(p, str) else base64.b64encode(bytes(p)).decode("ascii") for p in payloads]
    return json.dumps({"op": "bucket", "payloads": enc, "last": bool(last)})


def load_bucket(model, payload, last: bool = False) -> int:
    """Load one serialized FlattenedTensorBucket (bytes or base64) with the model's own ``load_weights``, then wait
    for the devices: no copy reads the sender's memory once this returns.  Returns the number of tensors loaded."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    obj = MultiprocessingSerializer.deserialize(payload)
    flat = obj["flattened_tensor"]
    named = FlattenedTensorBucket(flattened_tensor=flat, metadata=obj["metadata"]).reconstruct_tensors()
    model.load_weights(named)
    for dev in {flat.device} | {p.device for p in model.parameters()}:  # a no-op on the CPU
        torch.get_device_module(dev).synchronize(dev)
    keep_mapped(flat, last)
    return len(named)


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def load(model, named_tensors) -> None:
    """The custom loader SGLang calls (module docstring).  Raises ValueError for not exactly one ``(header,
    tensor)``, an unknown operation, or a bucket without this rank's payload."""
    named_tensors = list(named_tensors)
    if len(named_tensors) != 1:
        raise ValueError(f"{LOADER}: expected one (header, tensor), got {len(named_tensors)} entries")
    head = json.loads(named_tensors[0][0])
    rank, op = _tp_rank(), head.get("op")
    if op == "bucket":
        payloads = head["payloads"]
        if rank >= len(payloads):
            raise ValueError(f"{LOADER}: bucket with {len(payloads)} payloads, engine TP rank {rank} has none")
        load_bucket(model, payloads[rank], last=bool(head.get("last")))
    elif op == "dump":
        torch.save({n: p.detach().cpu().clone() for n, p in model.named_parameters()}, f"{head['out']}.rank{rank}.pt")
    else:
        raise ValueError(f"{LOADER}: unknown operation {op!r} (use 'bucket' or 'dump')")
