"""Weight sync of each model family (Llama-3 rope, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3) into a real SGLang CPU
engine: greedy generation after the sync equals HF's with the same weights, and the zero-copy and engine-layout
paths leave every engine parameter bitwise equal to the generic path's.  tests/support/dist/family_sync_e2e.py in the
shared 2-rank torchrun launch (tests/e2e/conftest.py): trainer TP2, one engine per family, one at a time, then the MoE
again at TP1 x EP2; each CHECK line is one test."""
import pytest

from tests.support.dist_utils import assert_check

KINDS = ("llama3", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
LAYOUT = ("zero_copy_equals_generic", "engine_layout_equals_generic")
EXPECTED = [f"{k}_{what}" for k in KINDS for what in ("initial_equals_hf", "synced_equals_hf", "outputs_changed",
                                                       "check_mode") + LAYOUT]
EXPECTED += ["deepseek_v3_cached_prefix_equals_hf"]
EXPECTED += [f"qwen3_moe_ep2_{what}" for what in ("synced_equals_hf", "outputs_changed", "check_mode") + LAYOUT]

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("family_sync_e2e.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
