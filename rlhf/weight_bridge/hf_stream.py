"""The HF tensor stream of a stage: TP gather -> convert -> (name, HF tensor), and buckets of it, on the stage leader
(docs/gpu.md, "Weight sync" 2.).  A production error on the leader (a conversion or a packing that raised: a CUDA OOM
allocating an oversize bucket, a stream out of plan) does not end its part in its TP and EP peers' collectives: it
goes on gathering without converting and yields the error in place of each later tensor and bucket.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from parallel.convert import GATHER_DIM, LocalTensor, hf_tensors_from_shards
from parallel.convert.params import param_role
from parallel.convert.shard_regions import Gathered, hf_parts_from_shards, hf_tensors_from_parts
from parallel.model_config import HFModelSpec
from rlhf import faults
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool, MemoryMeter, fill_buckets

__all__ = ["hf_stream", "stage_buckets", "Production", "threaded"]


@dataclass
class Production:
    """A stage leader's production state, shared by its stream and the bucket producer."""

    error: BaseException | None = None  # the first production error


def _detached(err: BaseException) -> BaseException:
    """``err`` without its frames (kept as text in a note): the failed conversion's frames hold the gathered shards
    (on GPU e.g. ~1 GiB of Qwen2-7B's embedding), which the leader's later gathers need back after an OOM."""
    err.add_note("".join(traceback.format_exception(err)).rstrip())
    chain = err
    while chain is not None:
        chain.__traceback__ = None
        chain = chain.__cause__ or chain.__context__
    return err


def _meta(shards: list) -> list:
    return [torch.empty(tuple(s.shape), dtype=s.dtype, device="meta") for s in shards]


def _convert(e: LocalTensor, shards: list, spec: HFModelSpec, state: Production,
             convert=None) -> list[tuple[str, object]]:
    """``convert`` (default hf_parts_from_shards) of one entry; after a production error (this or an earlier one)
    ``(HF name, the error)`` per HF tensor.  Fault point ``sync_convert_error`` (rlhf.faults): the conversion raises."""
    if state.error is None:
        try:
            if faults.fires("sync_convert_error"):
                raise RuntimeError(f"FAULT sync_convert_error: converting {e.local_name}")
            with torch.no_grad():
                return (convert or hf_parts_from_shards)(e.role, shards, spec)
        except Exception as err:  # noqa: BLE001 - the leader keeps step with its peers' gathers
            state.error = _detached(err)
    return [(name, state.error) for name, _ in hf_tensors_from_shards(e.role, _meta(shards), spec)]


def hf_stream(entries: Sequence[LocalTensor], topo, spec: HFModelSpec, meter: MemoryMeter, state: Production,
              pool: BufferPool | None = None) -> Iterator[tuple[str, object, bool]]:
    """``(HF name, HFTensorParts or full tensor, owned)`` on the stage leader (HFTensorParts view model memory, the
    bucket, ``pool``'s receive buffer: write each before taking the next); collective over the TP group (every TP rank
    iterates it to the end).  After a production error ``(name, the error, False)`` per tensor, raised last (leader)."""
    for e in entries:
        dim = GATHER_DIM[e.role.kind]
        if topo.ep_size > 1 and e.role.is_expert:
            yield from _expert_stream(e, topo, spec, meter, state)
            continue
        if dim is None and not topo.is_leader:
            continue
        shards = [e.values()] if dim is None else topo.gather(e, pool, spec)
        if topo.is_leader:
            outs = _convert(e, shards, spec, state)
            try:
                yield from ((name, t, False) for name, t in outs)
            finally:  # written by now, but not after a production error (nor when the drained stream is closed)
                _landed(shards)
            del shards
    if state.error is not None and topo.is_leader:
        raise state.error


def _landed(shards) -> None:
    if isinstance(shards, Gathered):
        shards.wait()


def _expert_stream(e: LocalTensor, topo, spec: HFModelSpec, meter: MemoryMeter, state: Production):
    """Expert parallelism: each EP rank's TP rank 0 gathers and converts a routed expert tensor, the EP group gathers
    the results on the stage leader, which yields them in EP-rank order under each rank's expert names.  After a
    production error the EP gathers still run, on uninitialised tensors of the converted shapes."""
    shards = topo.gather(e, spec=spec)
    if topo.tp_rank != 0:
        return
    outs = _convert(e, shards, spec, state, hf_tensors_from_parts)
    _landed(shards)
    if state.error is not None:
        outs = [(n, torch.empty(tuple(t.shape), dtype=t.dtype, device=shards[0].device))
                for n, t in hf_tensors_from_shards(e.role, _meta(shards), spec)]
    del shards
    per_tensor = [topo.gather_experts(t) for _, t in outs]
    del outs
    if not topo.is_leader:
        return
    nbytes = 0 if state.error is not None else sum(x.nbytes for g in per_tensor for x in g)
    meter.alloc(nbytes)
    try:
        for r in range(topo.ep_size):
            for name, gathered in zip(param_role(e.local_name, e.chunk, spec, ep_rank=r).hf_names, per_tensor):
                yield (name, state.error, False) if state.error is not None else (name, gathered[r], True)
    finally:
        del per_tensor
        meter.free(nbytes)


def threaded(it: Iterator) -> Iterator:
    """``it`` run in a daemon thread, one item ahead (its exceptions re-raised here), on the consumer's CUDA device:
    a new thread starts on cuda:0, where a leader on another GPU would gather its TP shards (group_device)."""
    q, end = queue.Queue(maxsize=1), object()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            for x in it:
                q.put(x)
            q.put(end)
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            q.put(e)

    threading.Thread(target=run, daemon=True).start()
    while (x := q.get()) is not end:
        if isinstance(x, BaseException):
            raise x
        yield x


def stage_buckets(entries: Sequence[LocalTensor], buckets: Sequence[BucketPlan], topo, spec: HFModelSpec,
                  pool: BufferPool, meter: MemoryMeter, overlap: bool,
                  times: dict) -> Iterator[tuple[BucketPlan, int | None, torch.Tensor | BaseException]]:
    """This stage's buckets ``(plan, pool slot, flat uint8 buffer)`` on the leader (the consumer releases each slot);
    with ``overlap`` a thread fills bucket k+1 while bucket k is delivered; ``times["produce"]``: the waits (s).
    After a production error ``(plan, None, the error)`` per bucket, each after the gathers of its tensors."""
    it = (threaded if overlap else iter)(_produce(entries, buckets, topo, spec, pool, meter))
    t0 = time.perf_counter()
    for x in it:
        times["produce"] += time.perf_counter() - t0
        yield x
        t0 = time.perf_counter()
    times["produce"] += time.perf_counter() - t0


def _produce(entries, buckets: Sequence[BucketPlan], topo, spec, pool: BufferPool, meter: MemoryMeter):
    state, taken, end = Production(), [0], 0

    def counted():
        for x in hf_stream(entries, topo, spec, meter, state, pool):
            taken[0] += 1
            yield x

    stream = counted()
    filled = fill_buckets(stream, buckets, pool)
    for bplan in buckets:
        end += len(bplan.metas)
        if state.error is None:
            try:
                yield next(filled)
                continue
            except Exception as err:  # noqa: BLE001 - reported per bucket by the consumer
                state.error = _detached(err)  # the stream now gathers without converting
        while taken[0] < end:  # this bucket's tensors: take part in the gathers the peers issue for them
            try:
                next(stream)
            except Exception:  # noqa: BLE001 - the stream ended (or its collective failed): nothing left to join
                break
        yield bplan, None, state.error
