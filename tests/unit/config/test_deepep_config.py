"""MoE token dispatch by DeepEP (verl's ``override_transformer_config.moe_token_dispatcher_type=flex`` and
``moe_enable_deepep=True``): the keys map onto ``model.moe_token_dispatcher_type`` / ``model.moe_enable_deepep`` and
reach megatron-core's TransformerConfig; what megatron refuses when the model is built is refused at --cfg; DeepEP's
CUDA kernels and the ``deep_ep`` package are checked at start, before any model is built (exit code 2 on CPU)."""
from __future__ import annotations

import pytest

from rlhf.config import ConfigValidationError, compose_config, validate_config
from rlhf.main import main
from tests.support.verl_examples import problems

TC = "+actor_rollout_ref.actor.megatron.override_transformer_config"
DEEPEP = [f"{TC}.moe_enable_deepep=True", f"{TC}.moe_token_dispatcher_type=flex"]


def test_verl_keys_reach_the_transformer_config():
    """verl's two keys -> ours -> megatron-core 0.16.1's TransformerConfig (flex with the DeepEP backend), built on
    a tiny Qwen3-MoE at EP 2 (no GPU: the config only, no dispatcher)."""
    import transformers

    from parallel.model_config import transformer_config_from_hf
    from rlhf.workers.build import model_config_kwargs
    from tests.support.model_families import _COMMON, FAMILY_MODELS

    c = compose_config([*DEEPEP, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"])
    assert (c.model.moe_token_dispatcher_type, c.model.moe_enable_deepep) == ("flex", True)
    cls, kw = FAMILY_MODELS["qwen3_moe"]
    hf = getattr(transformers, cls)(**{**_COMMON, **kw})
    kwargs = {k: v for k, v in model_config_kwargs(c).items() if k != "make_vocab_size_divisible_by"}
    tc = transformer_config_from_hf(hf, ep=2, **kwargs)
    assert (tc.moe_token_dispatcher_type, tc.moe_enable_deepep, tc.moe_flex_dispatcher_backend) == \
        ("flex", True, "deepep")
    default = transformer_config_from_hf(hf, ep=2, **{k: v for k, v in model_config_kwargs(compose_config([])).items()
                                                       if k != "make_vocab_size_divisible_by"})
    assert (default.moe_token_dispatcher_type, default.moe_enable_deepep) == ("alltoall", False)
    # the reference / critic sections take the actor's (verl's scripts set them on the actor only)
    assert compose_config([*DEEPEP, "+actor_rollout_ref.ref.megatron.override_transformer_config."
                                    "moe_token_dispatcher_type=alltoall"]).model.moe_token_dispatcher_type == "flex"


@pytest.mark.parametrize("overrides, expected", [
    (["model.moe_enable_deepep=true", "parallel.expert_model_parallel_size=2"],
     "model.moe_enable_deepep=true needs model.moe_token_dispatcher_type=flex (megatron's DeepEP backend is only "
     "supported with the flex dispatcher), not 'alltoall'; set it to flex, or drop moe_enable_deepep."),
    (["model.moe_token_dispatcher_type=flex"],
     "model.moe_token_dispatcher_type=flex exchanges tokens over the TP x EP ranks and needs more than one "
     "(megatron-core: 'Flex token dispatcher requires TPxEP > 1'); set parallel.expert_model_parallel_size > 1, or "
     "use alltoall."),
    (["model.moe_token_dispatcher_type=allgather"], "moe_token_dispatcher_type='allgather' must be alltoall or flex"),
])
def test_what_megatron_refuses_is_checked_at_cfg(overrides, expected):
    with pytest.raises(ConfigValidationError) as e:
        validate_config(compose_config(overrides), world_size=2)
    assert expected in str(e.value)


def test_preflight_refuses_deepep_on_cpu_and_without_deep_ep():
    from parallel.preflight import check_token_dispatcher

    fix = ("install DeepEP (https://github.com/deepseek-ai/DeepEP, the 'deep_ep' package) on the GPU nodes, or drop "
           "model.moe_enable_deepep and set model.moe_token_dispatcher_type=alltoall.")
    assert check_token_dispatcher("flex", True, "cpu") == [
        "model.moe_token_dispatcher_type=flex with model.moe_enable_deepep=true runs DeepEP's fused all-to-all, CUDA "
        "kernels only, but this run's device is cpu: " + fix]
    assert check_token_dispatcher("flex", False, "cuda", deep_ep_module="deep_ep_not_installed_here") == [
        "model.moe_token_dispatcher_type=flex runs DeepEP's fused all-to-all, but the 'deep_ep_not_installed_here' "
        "package is not importable here: install DeepEP (https://github.com/deepseek-ai/DeepEP, the "
        "'deep_ep_not_installed_here' package) on the GPU nodes, or drop model.moe_enable_deepep and set "
        "model.moe_token_dispatcher_type=alltoall."]
    assert check_token_dispatcher("flex", True, "cuda", deep_ep_module="json") == []  # an importable stand-in
    assert check_token_dispatcher("alltoall", False, "cpu") == []


def test_run_on_cpu_is_refused_before_any_model_in_verl_words(monkeypatch, capsys, tmp_path):
    """A run (not --cfg) of the tiny MoE recipe at EP 2 with verl's DeepEP keys exits 2 on this CPU machine, naming
    verl's keys, before Hydra starts the job (no model built); --cfg of the same command composes."""
    import rlhf.main as rlhf_main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("rlhf.launcher._cuda_count", lambda: 0)  # this machine is CPU-only; CI boxes may not be
    started = []
    monkeypatch.setattr(rlhf_main, "_run_hydra", lambda *a, **k: started.append(a) or 0)
    argv = ["recipe=moe_r3_tiny_cpu", f"trainer.default_local_dir={tmp_path}", *DEEPEP,
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]
    assert main(argv) == 2 and not started
    [line] = problems(capsys.readouterr().err)
    assert line == (f"{TC[1:]}.moe_token_dispatcher_type=flex with {TC[1:]}.moe_enable_deepep=true runs DeepEP's "
                    f"fused all-to-all, CUDA kernels only, but this run's device is cpu: install DeepEP "
                    f"(https://github.com/deepseek-ai/DeepEP, the 'deep_ep' package) on the GPU nodes, or drop "
                    f"{TC[1:]}.moe_enable_deepep and set {TC[1:]}.moe_token_dispatcher_type=alltoall."), line
    assert main(["--cfg", "job", *argv]) == 0 and len(started) == 1  # --cfg: checked, then handed to Hydra to print


def test_role_build_refuses_deepep_on_cpu_before_the_model(monkeypatch):
    """Runs not started by rlhf.main (rlhf.api.Trainer) meet the same check where a role's model is built: ValueError
    on this CPU rank before build_model_chunks; alltoall goes on to build."""
    from rlhf.workers import build

    built = []
    monkeypatch.setattr(build, "build_model_chunks", lambda *a, **k: built.append(k) or "chunks")
    monkeypatch.setattr("parallel.distributed.compute_device", lambda: __import__("torch").device("cpu"))
    c = compose_config(["model.moe_token_dispatcher_type=flex", "parallel.expert_model_parallel_size=2"])
    with pytest.raises(ValueError, match=r"model.moe_token_dispatcher_type=flex runs DeepEP's fused all-to-all, CUDA "
                                         r"kernels only, but this run's device is cpu"):
        build._chunks(c, None, "actor", "/nowhere", c.actor)
    assert built == []
    assert build._chunks(compose_config([]), None, "actor", "/nowhere", c.actor) == "chunks"
    assert built[0]["moe_token_dispatcher_type"] == "alltoall" and built[0]["moe_enable_deepep"] is False
