"""Buffer reuse in the colocated weight sync: once the engine replied to a bucket, no copy of it still reads the
sender's buffer (the bridge rewrites the buffer with the bucket after next).

On a GPU, SGLang's ``load_weights`` queues its copies on the device and SGLang's ``flattened_bucket`` update
replies without waiting for them.  Here a stand-in model queues its copies the same way and runs them only when
its device is synchronized (``torch.cpu.synchronize``, what rlhf.rollout.engine_loader.load_bucket calls for
a CPU device), or "later" (the test drains the queue after the sender reused its buffer).
"""
from __future__ import annotations

import torch

from rlhf.rollout import engine_loader
from rlhf.weight_bridge.bucketing import BufferPool, TensorMeta, bucket_views, plan_buckets
from rlhf.weight_bridge.from_tensor import prepare_sharing, serialize_bucket

SHAPES = {"a": (4,), "b": (2, 3)}


class _QueuedCopyModel(torch.nn.Module):
    """``load_weights`` queues ``param.copy_(tensor)`` like a device stream; :meth:`drain` runs the queue."""

    def __init__(self):
        super().__init__()
        for n, s in SHAPES.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s), requires_grad=False))
        self.queue: list = []

    def load_weights(self, named):
        for n, t in named:
            self.queue.append((getattr(self, n), t))  # t still views the sender's buffer

    def drain(self):
        while self.queue:
            p, t = self.queue.pop(0)
            p.data.copy_(t)


class _SGLangStandIn:
    """SGLang 0.5.23's dispatch of ``update_weights_from_tensor`` on each TP rank
    (model_runner_components/weight_updater.update_weights_from_tensor): ``flattened_bucket`` reconstructs the
    bucket and calls ``load_weights`` (no wait); a registered custom loader gets ``(name, tensor.to(device))``."""

    def __init__(self, models):
        self.models = models

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        for r, model in enumerate(self.models):
            if load_format == "flattened_bucket":
                obj = MultiprocessingSerializer.deserialize(named_tensors[r])
                model.load_weights(FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                                         metadata=obj["metadata"]).reconstruct_tensors())
            else:
                assert load_format == engine_loader.LOADER, load_format
                engine_loader._tp_rank = lambda r=r: r
                engine_loader.load(model, [(n, t.to("cpu")) for n, t in named_tensors])
        return True, "Success"


def test_reused_bucket_buffer_is_never_read_after_the_engine_replied(monkeypatch):
    """Bucket A goes out, the engine replies, the sender rewrites the same buffer with bucket B, then the device
    catches up: every TP rank of the engine must hold A (fails when the reply can precede the copies)."""
    from rlhf.rollout.sglang_engine import SGLangEngine

    models = [_QueuedCopyModel(), _QueuedCopyModel()]
    monkeypatch.setattr(torch.cpu, "synchronize", lambda device=None: [m.drain() for m in models])
    monkeypatch.setattr(engine_loader, "_tp_rank", engine_loader._tp_rank)  # the stand-in rebinds it per rank
    eng = object.__new__(SGLangEngine)
    eng.engine, eng.tp_size, eng._in_update, eng._updated = _SGLangStandIn(models), 2, True, False

    prepare_sharing(torch.device("cpu"))
    (plan,) = plan_buckets([TensorMeta(n, s, torch.float32) for n, s in SHAPES.items()])
    pool = BufferPool(plan.nbytes, shared=True)
    slot, buf = pool.acquire(plan.nbytes)
    bucket_a = {n: torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) + 1 for n, s in SHAPES.items()}
    for n, view in bucket_views(buf, plan):
        view.copy_(bucket_a[n])
    eng.update_weights_from_tensor(serialize_bucket(buf, plan, 2), flush_cache=False)
    for _n, view in bucket_views(buf, plan):  # the sender reuses the buffer as soon as the engine replied
        view.fill_(-7.0)
    for m in models:  # the device runs whatever was still queued
        m.drain()
    for r, m in enumerate(models):
        for n, want in bucket_a.items():
            assert torch.equal(getattr(m, n).data, want), (r, n, getattr(m, n).data)
    assert eng._updated
    pool.release(slot)
    pool.close()


def test_bucket_header_carries_each_rank_payload():
    """The ``bucket`` header holds TP rank r's payload at index r; a rank beyond the payloads is refused."""
    import base64
    import json

    head = json.loads(engine_loader.bucket_header([b"\x80\x05zero", "b25l"]))
    assert head["op"] == "bucket" and base64.b64decode(head["payloads"][0]) == b"\x80\x05zero"
    assert head["payloads"][1] == "b25l"  # already SGLang's base64 string: passed as it is
    model = _QueuedCopyModel()
    old = engine_loader._tp_rank
    try:
        engine_loader._tp_rank = lambda: 2
        try:
            engine_loader.load(model, [(json.dumps(head), torch.empty(0))])
        except ValueError as e:
            assert "engine TP rank 2 has none" in str(e)
        else:
            raise AssertionError("a rank without a payload must be refused")
    finally:
        engine_loader._tp_rank = old
