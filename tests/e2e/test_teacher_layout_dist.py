"""The on-policy distillation teacher on a grid of its own (``distill.teacher.tensor_model_parallel_size`` /
``pipeline_model_parallel_size``): at TP2 and at PP2 over a TP1 trainer it gives the TP1 teacher's per-token
log-probs, the trainer's grid is back after its forwards, and a PPO step with a TP2 teacher gives the TP1 step's
distill/ metrics.  Run in the shared 2-rank torchrun launch
(tests/e2e/conftest.py, tests/support/dist/teacher_layout_checks.py); each CHECK line is one test here."""
import pytest

from tests.support.dist_utils import assert_check

EXPECTED = ["teacher_tp2_is_sharded", "teacher_tp2_log_probs_equal_tp1", "teacher_pp2_log_probs_equal_tp1",
            "trainer_grid_restored", "ppo_step_with_a_tp2_teacher_equals_tp1"]
pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    return shared_dist_checks("teacher_layout_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
