"""parallel.devices (which device each process group takes, the one mover), the role seam of rlhf.workers.worker,
and the fake accelerator's guard (tests/support/fake_accelerator.py) firing on a wrong-device tensor.  CPU, fast
(one single-process gloo group where a group is needed)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from parallel import devices
from rlhf.workers.worker import MegatronWorker
from tests.support.dist_utils import free_port
from tests.support.fake_accelerator import ACCEL, DeviceError, FakeAccelerator, OnAccel
from tests.support.paths import ROOT


@pytest.mark.parametrize("backend,types", [("nccl", ["cuda"]), ("gloo", ["cpu"]), ("cpu:gloo,cuda:nccl", ["cpu", "cuda"]),
                                           ("cuda:gloo", ["cuda"])])
def test_group_device_types_from_the_backend(monkeypatch, backend, types):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert devices.group_device_types() == types


def test_group_device_prefers_the_compute_device_and_names_unknown_backends(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert devices.group_device() == torch.device("cpu")  # no CUDA here: the compute device is cpu, which gloo takes
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "fancy")
    with pytest.raises(ValueError, match="'fancy'.*cpu:gloo,cuda:nccl"):
        devices.group_device()


def test_to_device_moves_nested_tensors_and_copies_nothing_already_there():
    t = torch.ones(2)
    out = devices.to_device({"a": t, "b": [t, (t, 3)], "c": "x"}, "cpu")
    assert out["a"] is t and out["b"][0] is t and out["b"][1][0] is t and out["b"][1][1] == 3 and out["c"] == "x"
    meta = devices.to_device({"a": t}, "meta")
    assert meta["a"].device.type == "meta" and t.device.type == "cpu"


class _Role(MegatronWorker):
    """A role whose method records the device of the batch it computes on and returns device tensors."""

    def __init__(self, device):
        super().__init__(SimpleNamespace(chunks=[]), forward_micro_batch_size=1, device=device)

    def compute(self, batch, scale=1.0):
        self.seen = {k: v.device.type for k, v in batch.items() if torch.is_tensor(v)}
        return {"out": batch["input_ids"].float() * scale, "n": 3}

    def _private(self, batch):
        return batch["input_ids"]


def test_role_methods_taking_a_batch_enter_through_the_seam():
    role = _Role("meta")  # a device other than the caller's: the move is visible
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "prompt_length": 1}
    # on meta the values are gone, so the move back to the caller's device is checked on the fake below
    with pytest.raises(NotImplementedError):
        role.compute(batch)  # meta -> cpu copy: the result is moved back to the caller's device
    assert role.seen == {"input_ids": "meta"}
    assert _Role._private(role, batch).device.type == "cpu"  # private helpers are building blocks, not doors
    assert getattr(_Role.compute, "_role_entry", False) and not getattr(_Role._private, "_role_entry", False)


def test_role_seam_on_the_fake_accelerator_moves_in_and_back_out():
    batch = {"input_ids": torch.arange(6).view(2, 3), "prompt_length": 1}
    with FakeAccelerator():
        role = _Role(None)  # compute_device(): the accelerator
        assert role.device == ACCEL
        out = role.compute(batch, scale=2.0)
    assert role.seen == {"input_ids": "cpu"}  # real storage: cpu; tag: the accelerator
    assert type(out["out"]) is torch.Tensor and out["out"].tolist() == [[0, 2, 4], [6, 8, 10]] and out["n"] == 3


@pytest.fixture()
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_guard_fires_on_a_wrong_device_tensor_from_our_code(one_rank_group):
    from rlhf.workers.batch import dp_all_gather

    host = torch.ones(2, 3)
    with FakeAccelerator() as fa:
        with pytest.raises(DeviceError, match=r"all_reduce at parallel/devices_probe.*\(2, 3\) torch.float32 tensor on "
                                              r"cpu \(the group takes meta"):
            _all_reduce_from_parallel(host, one_rank_group)
        placed = dp_all_gather(host, one_rank_group, 2 - 1)  # dp 1: no collective
        assert placed is host
        out = _all_reduce_from_parallel(host.as_subclass(OnAccel), one_rank_group)
        assert out is None and fa.checked["all_reduce"] == 1
        dist.all_reduce(host, group=one_rank_group)  # called from the tests, not rlhf/ or parallel/: not checked
    assert fa.unchecked == 1 and len(fa.violations) == 1


def _all_reduce_from_parallel(t, group):
    """``dist.all_reduce(t, group=group)`` called from a frame whose file is under parallel/ (the guard checks the
    project's own call sites)."""
    code = compile("result = dist.all_reduce(t, group=group)", os.path.join(ROOT, "parallel", "devices_probe.py"),
                   "exec")
    scope = {"dist": dist, "t": t, "group": group}
    exec(code, scope)  # noqa: S102 - a frame attributed to parallel/, nothing else
    return scope["result"]


def test_torch_itself_refuses_cpu_tensors_on_a_cuda_only_group():
    """What the guard emulates, from torch: a group whose backend map has no cpu entry ("cuda:gloo", or NCCL on a
    GPU run) raises for a cpu tensor; parallel.devices names the device the group takes."""
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from parallel import devices
        dist.init_process_group("cuda:gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
        print("TYPES", devices.group_device_types())
        try:
            dist.all_reduce(torch.ones(2))
        except RuntimeError as e:
            print("REFUSED", e)
        dist.destroy_process_group()
    """ % free_port())
    env = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120).stdout
    assert "TYPES ['cuda']" in out and "REFUSED No backend type associated with device type cpu" in out, out
