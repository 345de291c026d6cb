"""The registries and the verl-compatible facade (rlhf/algorithms/registry.py, core_algos.py).

The registries are one dict each, the same object through rlhf.algorithms, core_algos and registry, so
verl's tests' MUTATION of the registry (``.clear()``, ``len``, registering into it) works through any of them.
verl's TestRegisterAdvEst (tests/trainer/ppo/test_core_algos_on_cpu.py) also rebinds the name in setUp
(``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``); rebinding a module's name is plain Python here (it does not
swap the registry), so the test case below puts setUp's dict into the registry instead.
"""

import os
import subprocess
import sys
import textwrap
import types
from enum import Enum

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
    with pytest.raises(ValueError, match=r"Unknown advantage estimator simply: ppo2.*'gae'.*'grpo'"):
        get_adv_estimator_fn("ppo2")


def test_policy_loss_registry():
    assert set(POLICY_LOSS_REGISTRY) >= {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"}
    assert get_policy_loss_fn("clip-cov") is get_policy_loss_fn("clip_cov")  # verl's docs spell it with '-'
    with pytest.raises(ValueError, match=r"Unsupported loss mode: ppo3.*'cispo'"):
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
    """Restore the estimator registry's contents after a test that clears or refills it."""
    contents = dict(registry.ADV_ESTIMATOR_REGISTRY)
    yield
    registry.ADV_ESTIMATOR_REGISTRY.clear()
    registry.ADV_ESTIMATOR_REGISTRY.update(contents)


MODULES = pytest.mark.parametrize("module", [core_algos, algorithms, registry],
                                  ids=["core_algos", "rlhf.algorithms", "registry"])


def test_the_registries_are_one_object_everywhere_and_no_module_class_is_swapped():
    from rlhf.algorithms.core_algos import ADV_ESTIMATOR_REGISTRY  # from-imports read the same dicts
    from rlhf.algorithms.core_algos import POLICY_LOSS_REGISTRY as from_imported_losses

    assert (core_algos.ADV_ESTIMATOR_REGISTRY is algorithms.ADV_ESTIMATOR_REGISTRY is registry.ADV_ESTIMATOR_REGISTRY
            is ADV_ESTIMATOR_REGISTRY)
    assert (core_algos.POLICY_LOSS_REGISTRY is algorithms.POLICY_LOSS_REGISTRY is registry.POLICY_LOSS_REGISTRY
            is from_imported_losses is POLICY_LOSS_REGISTRY)
    assert ADV_ESTIMATOR_REGISTRY["grpo"] is compute_grpo_outcome_advantage
    assert from_imported_losses["vanilla"] is core_algos.compute_policy_loss_vanilla
    assert type(core_algos) is type(algorithms) is type(registry) is types.ModuleType


@MODULES
def test_verls_mutation_pattern(module, saved_adv_registry):
    """verl's ``core_algos.ADV_ESTIMATOR_REGISTRY.clear()`` (through any of the three modules) empties the registry
    the lookups use; a name registered afterwards is found everywhere and passes the config's name check."""
    module.ADV_ESTIMATOR_REGISTRY.clear()
    assert len(registry.ADV_ESTIMATOR_REGISTRY) == 0 and len(core_algos.ADV_ESTIMATOR_REGISTRY) == 0
    core_algos.register_adv_est("estimator1")(len)
    assert algorithms.ADV_ESTIMATOR_REGISTRY == core_algos.ADV_ESTIMATOR_REGISTRY == {"estimator1": len}
    assert module.get_adv_estimator_fn("estimator1") is len
    assert "estimator1" in registry.adv_estimator_names()
    with pytest.raises(ValueError, match="Unknown advantage estimator simply: grpo"):
        core_algos.get_adv_estimator_fn("grpo")


@MODULES
def test_verls_register_adv_est_test_case(module, saved_adv_registry):
    """verl's TestRegisterAdvEst but for the module, with setUp's dict put INTO the registry (clear, update) rather
    than bound to the name: the functions (imported before) register into and look up in it; tearDown clears it."""
    register_adv_est, get_fn = core_algos.register_adv_est, core_algos.get_adv_estimator_fn
    module.ADV_ESTIMATOR_REGISTRY.clear()
    module.ADV_ESTIMATOR_REGISTRY.update({"gae": lambda x: x * 2, "vtrace": lambda x: x + 1})
    held = module.ADV_ESTIMATOR_REGISTRY
    init_count = len(held)

    def test_fn():
        pass

    class Estimators(Enum):
        TEST = "test_enum_estimator"

    assert register_adv_est("test_estimator")(test_fn) is test_fn and held["test_estimator"] is test_fn
    register_adv_est(Estimators.TEST)(test_fn)
    assert held["test_enum_estimator"] is test_fn
    register_adv_est("duplicate_test")(test_fn)
    register_adv_est("duplicate_test")(test_fn)
    assert held["duplicate_test"] is test_fn
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("duplicate_test")(lambda: None)
    assert len(held) == init_count + 3 and get_fn("gae")(5) == 10 and get_fn("vtrace")(5) == 6
    for name in ("grpo", "GAE", "invalid_name"):  # the built-ins went with clear(); lookups are case-sensitive
        with pytest.raises(ValueError, match=f"Unknown advantage estimator simply: {name}"):
            get_fn(name)
    assert core_algos.ADV_ESTIMATOR_REGISTRY is algorithms.ADV_ESTIMATOR_REGISTRY is registry.ADV_ESTIMATOR_REGISTRY
    assert registry.ADV_ESTIMATOR_REGISTRY is held
    module.ADV_ESTIMATOR_REGISTRY.clear()  # verl's tearDown
    assert len(held) == 0 and len(core_algos.ADV_ESTIMATOR_REGISTRY) == 0


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
    _run_fresh(code)


def test_importing_core_algos_loads_the_built_ins():
    """In a fresh interpreter, the registries from-imported from core_algos hold every built-in."""
    _run_fresh(textwrap.dedent("""
        from rlhf.algorithms.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
        from rlhf.algorithms import core_algos, registry
        assert sorted(ADV_ESTIMATOR_REGISTRY) == registry.adv_estimator_names(), ADV_ESTIMATOR_REGISTRY
        assert sorted(POLICY_LOSS_REGISTRY) == registry.policy_loss_names(), POLICY_LOSS_REGISTRY
        assert ADV_ESTIMATOR_REGISTRY["gae"] is core_algos.compute_gae_advantage_return
        assert POLICY_LOSS_REGISTRY["gspo"] is core_algos.compute_policy_loss_gspo
    """))


def _run_fresh(code: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
