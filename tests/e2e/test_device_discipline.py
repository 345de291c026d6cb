"""Device discipline (docs/gpu.md, "Devices"): on a GPU run megatron's groups are NCCL groups, which refuse host
tensors.  One torchrun launch of 2 gloo processes (tests/support/dist/device_checks.py) runs a DP2 PPO step (actor
and reference log-probs, critic values, both updates, weight sync, the padding metric) and a TP2 GRPO step
(vocab-parallel log-probs, the weight sync's TP gathers) under the fake accelerator
(tests/support/fake_accelerator.py): every collective of ours must get its tensors on the device its group takes,
every role batch must reach megatron's schedule on the role's device, and results come back to the caller.

Honest scope: on the CPU every real tensor is a cpu tensor, so "on the accelerator" is a tag the tensor
carries (put on by parallel.devices.to_device, the one mover, and carried by torch through ops); the fake's
docstring lists what it does and does not emulate.  Before the role seam and parallel.devices' placement
(today's main at the time), the DP2 step is refused at its first old-log-prob: the batch reaches
forward_backward on the host, and the DP all-gather and the padding all-reduce get host tensors; the checks
``dp2_guard_refuses_*`` keep both refusals tested.
"""
import os

import pytest

from tests.support.dist_utils import assert_check
from tests.support.paths import DIST_SCRIPTS

SCRIPT = os.path.join(DIST_SCRIPTS, "device_checks.py")
EXPECTED = ["dp2_ppo_step_every_collective_on_its_group_device", "dp2_role_results_come_back_on_host",
            "dp2_guard_refuses_a_role_call_without_its_door", "dp2_guard_refuses_a_host_tensor_in_the_dp_gather",
            "tp2_grpo_step_every_collective_on_its_group_device"]

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("device_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
