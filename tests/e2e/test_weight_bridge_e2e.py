"""Weight bridge end to end: megatron trainer (torchrun, 2 gloo processes) -> real SGLang engines.

tests/support/dist/bridge_e2e.py, run in the shared 2-rank torchrun launch (tests/e2e/conftest.py), starts two
engines once (rollout TP 1 and 2) and runs the trainer at TP2, PP2 and PP2 x VPP2 in the same processes; each
`CHECK` line it prints becomes one test here.  The engines' greedy output and per-token log-probs on their
initial weights are checked against HF first (the TP2 engine's are the rollout engine's TP2 check); after each
phase every engine parameter is compared bitwise with SGLang's own load of an HF export of the same weights.  About 3
minutes on an idle 2-core machine (engine start-up dominates).
"""
import pytest

from tests.support.dist_utils import assert_check

_STEPPED = [f"{phase}_{key}_step{step}_engine_equals_hf" for phase in ("tp2", "pp2") for step in (1, 2) for key in "AB"]
_STEPPED += [f"{phase}_B_step{step}_check_mode" for phase in ("tp2", "pp2") for step in (1, 2)]
_STEPPED += [f"{phase}_{key}_{what}" for phase in ("tp2", "pp2") for key in "AB"
             for what in ("engine_outputs_changed", "weights_changed_between_steps")]
_STEPPED += [f"{phase}_B_persistent_buffer_synced" for phase in ("tp2", "pp2")]
EXPECTED = (["engine_A_initial_equals_hf", "engine_B_initial_equals_hf", "engine_A_initial_log_probs_equal_hf",
             "engine_B_initial_log_probs_equal_hf"] + _STEPPED
            + ["pp2vpp2_A_step1_engine_equals_hf", "pp2vpp2_B_step1_engine_equals_hf", "pp2vpp2_B_step1_check_mode",
               "refused_unknown_name_engine_lives_on", "refused_wrong_shape_engine_lives_on",
               *[f"pp2_A_distributed_production_error_on_rank{r}_raises_everywhere_engine_lives_on" for r in (0, 1)],
               *[f"{phase}_B_local_handles_{what}" for phase in ("tp2", "pp2")
                 for what in ("entry_r_from_trainer_rank_r", "every_engine_parameter_equals_disk_load")]]
            + [f"{phase}_{key}_every_engine_parameter_equals_disk_load" for phase in ("tp2", "pp2", "pp2vpp2")
               for key in "AB"]
            + [f"tp1_{key}_{what}" for key in "AB"
               for what in ("every_engine_parameter_equals_disk_load", "check_mode", "engine_equals_hf")])

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("bridge_e2e.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
