"""The registries and the verl-compatible facade (rlhf/algorithms/registry.py, core_algos.py).

verl's tests (tests/trainer/ppo/test_core_algos_on_cpu.py, TestRegisterAdvEst) both MUTATE the registry
(``.clear()``, ``len``) and REBIND it (``core_algos.ADV_ESTIMATOR_REGISTRY = {...}`` in setUp, then
``register_adv_est`` / ``get_adv_estimator_fn`` imported before the rebinding must use the new dict).
Both patterns work here with plain modules: the dicts are one object each and the facades read them
from registry.py, which adopts a facade's rebinding at its next call.
"""

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import rlhf.algorithms as algorithms
import rlhf.algorithms.core_algos as core_algos
from rlhf.algorithms import (
    POLICY_LOSS_REGISTRY,
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_policy_loss,
)
from rlhf.algorithms import registry
from tests.support.paths import REPO

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


# ----------------------------------------------------------------- registry

@pytest.mark.parametrize(
    "name,fn",
    [
        ("gae", compute_gae_advantage_return),
        ("grpo", compute_grpo_outcome_advantage),
        ("rloo", compute_rloo_outcome_advantage),
        ("reinforce_plus_plus", compute_reinforce_plus_plus_outcome_advantage),
        ("reinforce_plus_plus_baseline", compute_reinforce_plus_plus_baseline_outcome_advantage),
    ],
)
def test_registry_lookup_by_string_and_enum(name, fn):
    assert get_adv_estimator_fn(name) is fn
    assert get_adv_estimator_fn(AdvantageEstimator(name)) is fn
    assert AdvantageEstimator(name) == name


def test_registry_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'ppo2'.*'gae'.*'grpo'"):
        get_adv_estimator_fn("ppo2")


def test_policy_loss_registry():
    assert set(POLICY_LOSS_REGISTRY) >= {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"}
    assert get_policy_loss_fn("clip-cov") is get_policy_loss_fn("clip_cov")  # verl's docs spell it with '-'
    with pytest.raises(ValueError, match=r"'ppo3'.*'cispo'"):
        get_policy_loss_fn("ppo3")
    with pytest.raises(ValueError, match="override=True"):
        register_policy_loss("vanilla")(lambda *a: None)

    def mine(*args, **kwargs):
        return torch.tensor(1.0), {}

    try:
        register_policy_loss("my_loss")(mine)
        register_policy_loss("my_loss")(mine)  # same function twice: no-op
        assert get_policy_loss_fn("my_loss") is mine
    finally:
        POLICY_LOSS_REGISTRY.pop("my_loss", None)


@pytest.fixture
def saved_adv_registry():
    """Restore the estimator registry (object and contents) after a test that clears or rebinds it."""
    original, contents = registry.ADV_ESTIMATOR_REGISTRY, dict(registry.ADV_ESTIMATOR_REGISTRY)
    yield
    # a rebinding left in a facade (adopted or not) goes; the original dict comes back, refilled
    for module in (core_algos, algorithms):
        vars(module).pop("ADV_ESTIMATOR_REGISTRY", None)
    registry.ADV_ESTIMATOR_REGISTRY = original
    original.clear()
    original.update(contents)


def test_the_registries_are_one_object_everywhere_and_no_module_class_is_swapped():
    for name in registry.REGISTRY_NAMES:
        assert getattr(core_algos, name) is getattr(algorithms, name) is getattr(registry, name)
        from rlhf.algorithms.core_algos import ADV_ESTIMATOR_REGISTRY  # from-imports read the same dict

        assert ADV_ESTIMATOR_REGISTRY is registry.ADV_ESTIMATOR_REGISTRY
    assert type(core_algos) is type(algorithms) is type(registry) is types.ModuleType


def test_verls_mutation_pattern_through_the_facade(saved_adv_registry):
    """verl's ``core_algos.ADV_ESTIMATOR_REGISTRY.clear()`` empties the registry the lookups use."""
    core_algos.ADV_ESTIMATOR_REGISTRY.clear()
    assert len(registry.ADV_ESTIMATOR_REGISTRY) == 0
    core_algos.register_adv_est("estimator1")(len)
    assert algorithms.ADV_ESTIMATOR_REGISTRY == {"estimator1": len}
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpo'"):
        core_algos.get_adv_estimator_fn("grpo")


@pytest.mark.parametrize("module", [core_algos, algorithms, registry], ids=["core_algos", "rlhf.algorithms",
                                                                           "registry"])
def test_verls_register_adv_est_test_case(module, saved_adv_registry):
    """verl's TestRegisterAdvEst, verbatim but for the module: setUp clears, then REBINDS the name; the
    functions (imported before) register into and look up in the new dict; tearDown clears it."""
    register_adv_est, get_fn = core_algos.register_adv_est, core_algos.get_adv_estimator_fn
    module.ADV_ESTIMATOR_REGISTRY.clear()
    module.ADV_ESTIMATOR_REGISTRY = {"gae": lambda x: x * 2, "vtrace": lambda x: x + 1}
    held = module.ADV_ESTIMATOR_REGISTRY
    init_count = len(held)

    def test_fn():
        pass

    assert register_adv_est("test_estimator")(test_fn) is test_fn and held["test_estimator"] is test_fn
    register_adv_est("duplicate_test")(test_fn)
    register_adv_est("duplicate_test")(test_fn)
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("duplicate_test")(lambda: None)
    assert len(held) == init_count + 2 and get_fn("gae")(5) == 10 and get_fn("vtrace")(5) == 6
    with pytest.raises(ValueError):
        get_fn("grpo")  # the built-ins went with the old dict
    assert core_algos.ADV_ESTIMATOR_REGISTRY is algorithms.ADV_ESTIMATOR_REGISTRY is registry.ADV_ESTIMATOR_REGISTRY
    module.ADV_ESTIMATOR_REGISTRY.clear()  # verl's tearDown
    assert len(held) == 0


def test_two_facades_rebound_to_different_dicts_is_refused(saved_adv_registry):
    core_algos.ADV_ESTIMATOR_REGISTRY = {}
    algorithms.ADV_ESTIMATOR_REGISTRY = {}
    with pytest.raises(ValueError, match="rebound to different dicts in"):
        get_adv_estimator_fn("grpo")


def test_a_lookup_through_the_torch_free_registry_loads_the_built_ins():
    """``import rlhf.algorithms.registry`` (config validation) loads no torch; its first lookup, or reading a
    registry through rlhf.algorithms (as ``sorted(algos.POLICY_LOSS_REGISTRY)`` at a test module's top does),
    imports and registers every built-in estimator and policy loss."""
    code = textwrap.dedent("""
        import sys
        from rlhf.algorithms import registry
        assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
        assert registry.adv_estimator_names()[:2] == ["gae", "gpg"] and not registry.ADV_ESTIMATOR_REGISTRY
        import rlhf.algorithms as algos
        assert sorted(algos.POLICY_LOSS_REGISTRY) == registry.policy_loss_names(), algos.POLICY_LOSS_REGISTRY
        fn = registry.get_adv_estimator_fn("grpo")
        assert fn.__module__ == "rlhf.algorithms.estimators.grpo", fn.__module__
        assert sorted(registry.ADV_ESTIMATOR_REGISTRY) == registry.adv_estimator_names()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
