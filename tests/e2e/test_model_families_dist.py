"""Every supported model family vs Hugging Face at TP1/TP2/PP2 (+EP2, TP2xEP2 for MoE, an uneven
pipeline), HF round trips, log-probs, moe/* metrics and a MoE checkpoint reshard: one torchrun
launch of 4 gloo processes (tests/support/dist/family_checks.py); each CHECK line is one test here."""
import os

import pytest

from tests.support.dist.family_checks import DENSE, LAYOUTS, MOE, layout_name
from tests.support.dist_utils import assert_check
from tests.support.paths import DIST_SCRIPTS

SCRIPT = os.path.join(DIST_SCRIPTS, "family_checks.py")


def _expected():
    names = []
    for tp, pp, ep, first in LAYOUTS:
        lay = layout_name(tp, pp, ep, first)
        for kind in DENSE + MOE:
            if ep > 1 and kind not in MOE or first and kind not in ("qwen3", "qwen3_moe"):
                continue
            names += [f"logits_{kind}_{lay}", f"round_trip_{kind}_{lay}"]
            if (tp, pp, ep) == (2, 1, 1):
                names.append(f"log_probs_{kind}_{lay}")
                if kind == "qwen3":
                    names.append(f"walk_{kind}_{lay}")
            if kind == "qwen3_moe" and (tp, pp, ep) == (2, 1, 2):
                names.append(f"moe_metrics_{kind}_{lay}")
    return names + ["dist_checkpoint_qwen3_moe_tp2ep2_save_pp2_load"]


EXPECTED = _expected()
pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("family_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
