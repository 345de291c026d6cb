"""The overlap producer thread (rlhf.weight_bridge.hf_stream.threaded) runs on its creator's CUDA device.

CUDA's current device is per host thread and a new thread starts on cuda:0; a stage leader on another GPU
(PP > 1) would otherwise gather its TP shards on cuda:0.  Simulated on the CPU: torch.cuda's current device
is replaced by a per-thread value that starts at 0 in every new thread, as CUDA's does."""
import threading

import torch

from rlhf.weight_bridge.hf_stream import threaded


def _fake_per_thread_cuda(monkeypatch):
    local = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(local, "device", int(d)))


def test_producer_thread_uses_the_creators_device(monkeypatch):
    _fake_per_thread_cuda(monkeypatch)
    torch.cuda.set_device(4)  # a stage leader on GPU 4

    def produce():
        for i in range(3):
            yield i, torch.cuda.current_device(), threading.get_ident()

    seen = list(threaded(produce()))
    assert [i for i, _, _ in seen] == [0, 1, 2]
    assert {t for _, _, t in seen} != {threading.get_ident()}  # it did run in another thread
    assert {d for _, d, _ in seen} == {4}


def test_cpu_thread_sets_no_device():
    calls = []
    real = torch.cuda.set_device
    try:
        torch.cuda.set_device = lambda d: calls.append(d)
        assert list(threaded(iter([1, 2]))) == [1, 2]
    finally:
        torch.cuda.set_device = real
    assert calls == []  # no CUDA here: nothing is set


def test_errors_still_reach_the_consumer():
    def bad():
        yield 1
        raise ValueError("boom")

    it = threaded(bad())
    assert next(it) == 1
    try:
        next(it)
    except ValueError as e:
        assert "boom" in str(e)
    else:
        raise AssertionError("the producer's error was lost")
