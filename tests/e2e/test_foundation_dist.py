"""Megatron models vs Hugging Face under TP/PP/DP (one torchrun launch of 4 gloo processes).

Each CHECK line printed by tests/support/dist/foundation_checks.py becomes one test here.
"""
import os

import pytest

from tests.support.dist_utils import assert_check
from tests.support.paths import DIST_SCRIPTS

SCRIPT = os.path.join(DIST_SCRIPTS, "foundation_checks.py")
KINDS = ["llama_gqa", "llama_mha", "qwen2_tied", "llama_square"]
LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]
EXPECTED = (
    [f"{what}_{k}_{l}" for l in LAYOUTS for k in KINDS for what in ("logits", "log_probs_entropy", "round_trip")]
    + ["sequence_parallel_tp2_odd_lengths_log_probs_values", "sequence_parallel_tp2_train_step_loss_grad_norm"]
    + ["optimizer_step_tp2_dp2_distributed_optimizer", "dist_checkpoint_tp2_save_tp1_load",
       "missing_tensor_error_names_it", "context_parallel_cp2_tp2_log_probs_entropy_values_grads"]
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("foundation_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
