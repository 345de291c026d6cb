"""The HF tensor stream of a stage: TP gather -> convert -> (name, full HF tensor), and buckets of it.  Only the
stage leader yields; it holds one parameter's gathered shards and converted copy at a time.  A production error on
the leader (a conversion or a packing that raised: a CUDA OOM in ``torch.cat`` of the embedding, a stream out of
plan) does not end its part in its TP and EP peers' collectives: it goes on gathering without converting and yields
the error in place of each later tensor and bucket; the delivery reports it and moves nothing more.
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


def _convert(e: LocalTensor, shards: list, spec: HFModelSpec, state: Production) -> list[tuple[str, object]]:
    """``hf_tensors_from_shards`` of one entry; after a production error (this or an earlier one) ``(HF name, the
    error)`` per HF tensor.  Fault point ``sync_convert_error`` (rlhf.faults): this conversion raises."""
    if state.error is None:
        try:
            if faults.fires("sync_convert_error"):
                raise RuntimeError(f"FAULT sync_convert_error: converting {e.local_name}")
            with torch.no_grad():
                return hf_tensors_from_shards(e.role, shards, spec)
        except Exception as err:  # noqa: BLE001 - the leader keeps step with its peers' gathers
            state.error = _detached(err)
    return [(name, state.error) for name, _ in hf_tensors_from_shards(e.role, _meta(shards), spec)]


def hf_stream(entries: Sequence[LocalTensor], topo, spec: HFModelSpec, meter: MemoryMeter,
              state: Production | None = None) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(HF name, full tensor, owned)`` on the stage leader (``owned=False``: it aliases model memory); collective
    over the TP group (every TP rank iterates it to the end).  After a production error ``(name, the error, False)``
    per tensor, the error raised once every entry was gathered (an EP peer's error reaches its caller so)."""
    state = state if state is not None else Production()
    for e in entries:
        dim = GATHER_DIM[e.role.kind]
        if topo.ep_size > 1 and e.role.is_expert:
            yield from _expert_stream(e, topo, spec, meter, state)
            continue
        if dim is None and not topo.is_leader:
            continue
        shards = [e.values()] if dim is None else topo.gather(e)
        if not topo.is_leader:
            continue
        gathered = sum(x.nbytes for x in shards) if dim is not None and topo.tp_size > 1 else 0
        outs = _convert(e, shards, spec, state)
        del shards
        if state.error is not None:
            yield from ((name, err, False) for name, err in outs)
            continue
        converted = 0 if dim is None else sum(t.nbytes for _, t in outs)
        meter.alloc(gathered + converted)  # the high-water mark: both alive while converting
        meter.free(gathered)
        try:
            while outs:
                name, t = outs.pop(0)
                yield name, t, dim is not None
                del t
        finally:
            del outs
            meter.free(converted)
    if state.error is not None:
        raise state.error


def _expert_stream(e: LocalTensor, topo, spec: HFModelSpec, meter: MemoryMeter, state: Production):
    """Expert parallelism: each EP rank's TP rank 0 gathers and converts a routed expert tensor, the EP group gathers
    the results on the stage leader, which yields them in EP-rank order under each rank's expert names.  After a
    production error the EP gathers still run, on uninitialised tensors of the converted shapes."""
    shards = topo.gather(e)
    if topo.tp_rank != 0:
        return
    outs = _convert(e, shards, spec, state)
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
        for x in hf_stream(entries, topo, spec, meter, state):
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
