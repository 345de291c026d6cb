"""parallel.layouts.ParallelLayout on one gloo rank: building the second grid leaves the trainer's grid usable (its
gloo groups, which megatron-core's destroy_model_parallel destroys, stay registered and work) and both grids share
one global memory buffer.  In-process, one rank."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from tests.support.dist_utils import one_rank_grid

    with one_rank_grid(tmp_path_factory.mktemp("pg")):
        yield


def test_second_grid_keeps_the_trainers_gloo_groups_alive(grid):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel.layouts import ParallelLayout

    gloo, buf = ps.get_data_parallel_group_gloo(), ps._GLOBAL_MEMORY_BUFFER
    layout = ParallelLayout(1, 1)
    assert ps.get_data_parallel_group_gloo() is gloo
    # destroyed before the fix: "Group ... is not registered" on every call below
    assert dist.get_process_group_ranks(gloo) == [0]
    t = torch.ones(2)
    dist.all_reduce(t, group=gloo)
    assert t.tolist() == [1.0, 1.0]
    objs = [None]
    dist.broadcast_object_list(objs if dist.get_rank() else [7], src=0, group=gloo)
    with layout:
        assert ps._GLOBAL_MEMORY_BUFFER is buf  # shared, as the module says (a second one was made before)
        assert ps.get_data_parallel_group_gloo() is not None
    assert ps.get_data_parallel_group_gloo() is gloo and ps._GLOBAL_MEMORY_BUFFER is buf
