"""The verl-compatible facade: names, and registries forwarded BY REFERENCE (verl's tests replace
``core_algos.ADV_ESTIMATOR_REGISTRY`` and expect ``register_adv_est`` to write into the new dict)."""

import pytest

import rlhf.algorithms as algorithms
import rlhf.algorithms.core_algos as core_algos
from rlhf.algorithms import registry

VERL_NAMES = [
    "ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY", "AdvantageEstimator", "AdaptiveKLController",
    "FixedKLController", "agg_loss", "compute_entropy_loss", "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage", "compute_grpo_outcome_advantage", "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage", "compute_opo_outcome_advantage", "compute_policy_loss",
    "compute_policy_loss_cispo", "compute_policy_loss_clip_cov", "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg", "compute_policy_loss_gspo", "compute_policy_loss_kl_cov", "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla", "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage", "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage", "compute_rloo_vectorized_outcome_advantage", "compute_value_loss",
    "get_adv_estimator_fn", "get_kl_controller", "get_policy_loss_fn", "kl_penalty", "register_adv_est",
    "register_policy_loss",
]


def test_verl_names_exist():
    for name in VERL_NAMES:
        assert hasattr(core_algos, name) and hasattr(algorithms, name), name
    assert set(core_algos.__all__) >= set(VERL_NAMES)


@pytest.mark.parametrize("module", [core_algos, algorithms], ids=["core_algos", "rlhf.algorithms"])
@pytest.mark.parametrize("name,register,get", [
    ("ADV_ESTIMATOR_REGISTRY", "register_adv_est", "get_adv_estimator_fn"),
    ("POLICY_LOSS_REGISTRY", "register_policy_loss", "get_policy_loss_fn"),
])
def test_replacing_a_registry_through_the_facade_takes_effect(module, name, register, get):
    original = getattr(registry, name)
    try:
        replacement = {"existing": len}
        setattr(module, name, replacement)
        assert getattr(core_algos, name) is replacement and getattr(algorithms, name) is replacement

        def fn():
            return "mine"

        getattr(module, register)("new_entry")(fn)
        assert replacement["new_entry"] is fn
        assert getattr(module, get)("existing") is len
        with pytest.raises(ValueError, match="'compute'"):
            getattr(module, get)("compute")
    finally:
        setattr(registry, name, original)
    assert getattr(core_algos, name) is original and "grpo" in registry.ADV_ESTIMATOR_REGISTRY
