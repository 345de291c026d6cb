"""Initial weights from a megatron dist checkpoint (``actor/critic.use_dist_checkpointing``): tiny DeepSeek-V3 and
Qwen3 checkpoints converted at TP2 / PP2 start the trainer's roles at TP1, PP2, TP2 with the weights, log-probs
and first update of a start from the HF safetensors; the --cfg check accepts them and names a mismatch.  Run in
the shared 2-rank torchrun launch (tests/e2e/conftest.py, tests/support/dist/init_checkpoint_checks.py); each
CHECK line is one test here."""
import pytest

from tests.support.dist_utils import assert_check

SCENARIOS = ("deepseek_v3_tp2_to_tp1", "deepseek_v3_tp2_to_pp2", "qwen3_pp2_to_tp2")
EXPECTED = ["cfg_check_accepts_the_converted_checkpoints", "cfg_check_names_the_mismatch"]
EXPECTED += [f"{s}_{what}" for s in SCENARIOS for what in ("build", "weights", "log_probs", "first_update")]
EXPECTED += [f"qwen3_pp2_to_tp1_ppo_{what}" for what in ("weights", "log_probs", "first_step")]
pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    return shared_dist_checks("init_checkpoint_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
