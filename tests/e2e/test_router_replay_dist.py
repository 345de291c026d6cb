"""MoE routing replay under EP2, PP2 and TP2 (sequence parallel) against the unsharded model, for Qwen3-MoE, Mixtral
and DeepSeek-V3 (first layer dense, grouped sigmoid routing): tests/support/dist/router_replay_checks.py under torchrun
(2 gloo processes, in the shared launch of tests/e2e/conftest.py).  Per layout and family: the recorded routing and
the log-probs equal the unsharded run's; a given random routing is replayed exactly (recorded back) and gives the
unsharded model's log-probs under the same replay (<= 1e-5), which differ from its own routing's.  At PP2 a full
recompute gives the gradients of no recompute (megatron's REPLAY_BACKWARD queue in the 1F1B order)."""
import os

import pytest

from tests.support.dist.router_replay_checks import FAMILIES, LAYOUTS
from tests.support.dist_utils import assert_check
from tests.support.paths import DIST_SCRIPTS

SCRIPT = os.path.join(DIST_SCRIPTS, "router_replay_checks.py")
EXPECTED = [f"router_replay_{kind}_tp{tp}pp{pp}{f'ep{ep}' if ep > 1 else ''}_{what}"
            for tp, pp, ep in LAYOUTS for kind in FAMILIES for what in ("records_own_routing", "replays_given_routing")]
EXPECTED.append("router_replay_qwen3_moe_tp1pp2_full_recompute_replays_in_backward")

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("router_replay_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
