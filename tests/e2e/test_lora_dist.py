"""LoRA on the megatron actor end to end on CPU: tests/support/dist/lora_checks.py (2 gloo processes, in the shared
2-rank torchrun launch of tests/e2e/conftest.py) runs LoRA at trainer TP1 (DP2) and TP2 (gradients also under sequence parallelism), then two GRPO steps of the PPO trainer at TP2 with the
in-process HF engine double fed by the real weight bridge, then LoRA on a tiny Qwen3-MoE's experts at EP2 and expert TP2
against EP1; each `CHECK` line becomes one test here.
About 4 minutes on a loaded 2-core machine (model builds and checkpoint saves dominate)."""
import pytest

from tests.support.dist_utils import assert_check

_PER_TP = ["adapters_changed", "base_bitwise_unchanged", "optimizer_holds_only_adapters", "reference_is_base",
           "bridge_sends_merged", "hf_merged_logits", "peft_export", "checkpoint_adapters_only", "resume_exact"]
EXPECTED = ([f"{p}_{c}" for p in ("tp1", "tp2") for c in _PER_TP] + ["tp2_tp_grads_equal_tp1", "tp2sp_tp_grads_equal_tp1"]
            + [f"grpo_{c}" for c in ("reference_is_adapters_off_actor", "adapters_changed", "base_bitwise_unchanged",
                                      "engine_weights_are_merged_export", "checkpoint_adapters_only")]
            + ["moe_ep1_adapters_on_every_expert"]
            + [f"moe_{p}_{c}" for p in ("ep2", "tp2") for c in ("log_probs_and_export_equal_unsharded", "sharding",
                                                                "grads_equal_unsharded")])

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(shared_dist_checks):
    # one torchrun launch with the other collected check scripts of its world size (tests/e2e/conftest.py)
    return shared_dist_checks("lora_checks.py")


@pytest.mark.parametrize("name", EXPECTED)
def test_check(checks, name):
    assert_check(checks, name)
