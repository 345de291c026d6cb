"""init_model_parallel: tp/pp/vpp/ep/etp/cp reach megatron-core's initialize_model_parallel; the device rule."""
import pytest
import torch

from parallel import distributed
from parallel.distributed import check_parallel_sizes, compute_device, init_model_parallel


class FakeParallelState:
    """Stands in for megatron.core.parallel_state: records initialize/destroy calls."""

    def __init__(self):
        self.calls, self.destroyed, self.sizes = [], 0, None

    def model_parallel_is_initialized(self):
        return self.sizes is not None

    def initialize_model_parallel(self, **kw):
        self.calls.append(kw)
        self.sizes = kw

    def destroy_model_parallel(self):
        self.destroyed += 1
        self.sizes = None

    def get_tensor_model_parallel_world_size(self):
        return self.sizes["tensor_model_parallel_size"]

    def get_pipeline_model_parallel_world_size(self):
        return self.sizes["pipeline_model_parallel_size"]

    def get_virtual_pipeline_model_parallel_world_size(self):
        return self.sizes["virtual_pipeline_model_parallel_size"]

    def get_expert_model_parallel_world_size(self):
        return self.sizes["expert_model_parallel_size"]

    def get_expert_tensor_parallel_world_size(self):
        return self.sizes["expert_tensor_parallel_size"]

    def get_context_parallel_world_size(self):
        return self.sizes["context_parallel_size"]


@pytest.fixture
def fake_ps(monkeypatch):
    import megatron.core

    fake = FakeParallelState()
    monkeypatch.setattr(megatron.core, "parallel_state", fake)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 8)
    return fake


def test_ep_and_etp_reach_megatron(fake_ps):
    init_model_parallel(2, 1, ep=4)
    assert fake_ps.calls[-1] == dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                     virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=4,
                                     expert_tensor_parallel_size=2, context_parallel_size=1)
    init_model_parallel(2, 1, ep=4)  # same sizes: idempotent
    assert len(fake_ps.calls) == 1 and fake_ps.destroyed == 0
    init_model_parallel(2, 1, ep=8, etp=1)  # new expert layout: torn down and rebuilt
    assert fake_ps.destroyed == 1 and fake_ps.calls[-1]["expert_model_parallel_size"] == 8
    assert fake_ps.calls[-1]["expert_tensor_parallel_size"] == 1
    init_model_parallel(2, 2, vpp=2)  # dense defaults: ep 1, etp = tp
    last = fake_ps.calls[-1]
    assert last["expert_model_parallel_size"] == 1 and last["expert_tensor_parallel_size"] == 2
    init_model_parallel(2, 2, cp=2)  # context parallel: a new layout
    assert fake_ps.calls[-1]["context_parallel_size"] == 2 and fake_ps.destroyed == 3


@pytest.mark.parametrize("sizes,match", [
    (dict(tp=3), "tp=3 x pp=1 must divide world_size=8"),
    (dict(tp=2, pp=1, vpp=2), "vpp=2 needs pp > 1"),
    (dict(tp=2, ep=8), "ep=8 x expert tp=2 x pp=1 must divide world_size=8"),
    (dict(tp=1, pp=2, ep=3), "ep=3"),
    (dict(ep=0), "ep=0"),
    (dict(tp=2, pp=2, cp=4), "tp=2 x cp=4 x pp=2 must divide world_size=8"),
])
def test_bad_sizes_are_refused_before_megatron(fake_ps, sizes, match):
    with pytest.raises(ValueError, match=match):
        init_model_parallel(**sizes)
    assert fake_ps.calls == []


def test_check_parallel_sizes_accepts_expert_grid():
    check_parallel_sizes(8, tp=2, pp=2, ep=2)  # 2 x 2 x 2 = 8
    check_parallel_sizes(8, tp=4, ep=8, etp=1)  # experts over all 8 ranks, no expert TP


def test_compute_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compute_device() == torch.device("cpu")
