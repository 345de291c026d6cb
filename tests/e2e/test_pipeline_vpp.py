"""The VPP micro-batch rule on megatron's real interleaved schedule: tests/support/dist/vpp_checks.py under torchrun (2 gloo
processes, PP2 x VPP2 next to PP2).  Before the fix, 3 sequences (one micro batch) made the interleaved
schedule raise ("The number of contiguous micro-batches in a virtual pipeline stage should range in [PP=2 ,
M=1]").  The same launch also checks, at TP2, that sequence parallelism leaves every critic and actor gradient
unchanged (before the fix the critic's value head doubled every trunk gradient: grad-norm ratio 2.0).  About 1-2 minutes on the shared 2-core machine (no engine)."""
import os

import pytest

from tests.support.dist_utils import assert_check
from tests.support.paths import DIST_SCRIPTS

SCRIPT = os.path.join(DIST_SCRIPTS, "vpp_checks.py")
EXPECTED = ["pp2_odd_batch_log_probs_equal_hf", "pp2vpp2_odd_batch_log_probs_equal_hf", "vpp_update_equals_pp_update",
            # the same launch at TP2: gradients with sequence parallelism on vs off (tests/support/dist/sp_grad_checks.py)
            "sequence_parallel_tp2_critic_grads_equal_every_param", "sequence_parallel_tp2_actor_grads_equal_every_param"]

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("vpp_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
