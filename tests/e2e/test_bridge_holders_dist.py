"""Engine-local bucket handles at PP 1 and PP 2, and under expert parallelism (EP2 x PP2, TP2 x EP2) on 2 simulated
nodes, on 4 gloo ranks with in-memory engines: which trainer rank's memory
each engine TP rank maps, bitwise equality with the checkpoint, nothing serialized that is not
delivered (failed sync, replaced engine), pools freed after the engines' last reply, the broadcasts on an existing
group (world or TP), a production error on a stage leader raised on every rank (no peer left in a gather).  One check script
(tests/support/dist/holder_checks.py) in the shared 4-rank launch (tests/e2e/conftest.py); each CHECK line is one
test here."""
import pytest

from tests.support.dist.holder_checks import LAYOUTS, checks, layout_name
from tests.support.dist_utils import assert_check

EXPECTED = [f"holders_{layout_name(*lay)}_{c}" for lay in LAYOUTS for c in checks(lay[2])]
pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("holder_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
