"""Optimizer safety under torchrun (2 gloo processes, DP2): inf-gradient step is a bitwise no-op,
bitwise resume with and without the distributed optimizer (full and slim checkpoints), slim size.

Each CHECK line printed by tests/support/dist/optim_safety_checks.py becomes one test here.
"""
import os

import pytest

from tests.support.dist_utils import assert_check
from tests.support.paths import DIST_SCRIPTS

SCRIPT = os.path.join(DIST_SCRIPTS, "optim_safety_checks.py")
EXPECTED = ["megatron_core_steps_on_inf_grad", "inf_grad_step_is_noop_plain", "inf_grad_step_is_noop_distopt",
            "resume_bitwise_plain", "resume_bitwise_distopt", "slim_checkpoint_size", "slim_drops_frozen_params",
            "tied_weights_saved_once_pp2"]

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("optim_safety_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
