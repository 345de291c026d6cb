"""Weight sync of each model family (Llama-3 rope, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3) into a real SGLang CPU
engine: greedy generation after the sync equals HF's with the same weights, and every engine parameter is bitwise
what SGLang's own loading from disk gives for an HF export of the same weights.  tests/support/dist/family_sync_e2e.py
in the shared 2-rank torchrun launch, after bridge_e2e.py (tests/e2e/conftest.py): trainer TP2, one engine per
family (the next one booting meanwhile), then the MoE again at TP1 x EP2, then every family at trainer PP2 and TP1
into the same engine, then at trainer TP2, PP2 and TP1 into an engine of TP2; each CHECK line is one test."""
import pytest

from tests.support.dist_utils import assert_check

KINDS = ("llama3", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
LAYOUT = ("every_engine_parameter_equals_disk_load",)
EXPECTED = [f"{k}_{what}" for k in KINDS for what in ("initial_equals_hf", "synced_equals_hf", "outputs_changed",
                                                       "check_mode") + LAYOUT]
EXPECTED += ["deepseek_v3_cached_prefix_equals_hf"]
EXPECTED += [f"qwen3_moe_ep2_{what}" for what in ("synced_equals_hf", "outputs_changed", "check_mode") + LAYOUT]
EXPECTED += [f"{k}{t}_{what}" for k in KINDS for t in ("_pp2", "_tp1", "_etp2_pp2", "_etp2_tp1")
             for what in ("synced_equals_hf", "outputs_changed", "check_mode") + LAYOUT]
EXPECTED += [f"{k}_etp2_{what}" for k in KINDS
             for what in ("initial_equals_hf", "synced_equals_hf", "outputs_changed", "check_mode") + LAYOUT]

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("family_sync_e2e.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
