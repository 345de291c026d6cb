"""verl's ``actor_rollout_ref.rollout.engine_kwargs.sglang.*`` (rollout.engine_kwargs.sglang here) reaches SGLang's
ServerArgs as given; a key that is not a ServerArgs field, or one the config sets otherwise, is refused at start-up
naming the key as typed.  CPU, no engine started."""
from __future__ import annotations


import pytest

from rlhf.config import ConfigValidationError, compose_config, validate_config
from rlhf.rollout.engine_args import engine_kwargs
from rlhf.workers.rollout import rollout_engine_config
from tests.support.verl_examples import problems, run_cfg
from tests.unit.config.test_verl_compat import _model_dir


def test_verl_engine_kwargs_reach_sglang_server_args(gsm8k_row_file, tmp_path):
    """attention_backend and chunked_prefill_size given in verl's keys end up in the ServerArgs the engine is
    started with (rlhf.rollout.manager builds the sglang.Engine kwargs exactly so); was dropped with a "no effect"
    line."""
    from sglang.srt.server_args import ServerArgs

    model = _model_dir(tmp_path / "qwen")
    cfg = compose_config([f"data.train_files={gsm8k_row_file}", f"actor_rollout_ref.model.path={model}",
                          "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
                          "actor_rollout_ref.rollout.engine_kwargs.sglang.chunked_prefill_size=1024"])
    assert dict(cfg.rollout.engine_kwargs.sglang) == {"attention_backend": "triton", "chunked_prefill_size": 1024}
    conf = rollout_engine_config(cfg, str(model), "cpu")
    kw = engine_kwargs(**conf.pop("engine_overrides"), **conf)  # as RolloutManager does
    args = ServerArgs(**kw)
    assert (args.attention_backend, args.chunked_prefill_size) == ("triton", 1024)
    assert args.tp_size == cfg.rollout.tensor_model_parallel_size  # the config's own settings stay


def test_unknown_or_owned_server_args_are_refused_by_the_key_typed(gsm8k_row_file, tmp_path):
    model = _model_dir(tmp_path / "qwen")
    code, _, err = run_cfg([f"data.train_files={gsm8k_row_file}", f"actor_rollout_ref.model.path={model}",
                            "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backnd=triton",
                            "actor_rollout_ref.rollout.engine_kwargs.sglang.tp_size=4"])
    assert code == 2
    lines = problems(err)
    assert any(p.startswith("actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backnd: 'attention_backnd' is "
                            "not a field of SGLang's ServerArgs") and "did you mean attention_backend" in p
               for p in lines), err
    assert any(p.startswith("actor_rollout_ref.rollout.engine_kwargs.sglang.tp_size is set from the config here; set "
                            "actor_rollout_ref.rollout.tensor_model_parallel_size") for p in lines), err
    cfg = compose_config([f"data.train_files={gsm8k_row_file}", f"model.path={model}",
                          "rollout.engine_kwargs.sglang.no_such_field=1"])  # our key: named as ours
    with pytest.raises(ConfigValidationError, match=r"rollout\.engine_kwargs\.sglang\.no_such_field: 'no_such_field'"):
        validate_config(cfg)


@pytest.mark.parametrize("key,value,why", [
    ("device", "cuda", "placement plan gives each engine its device"),  # was a TypeError at the engine's start
    ("base_gpu_id", 0, "placement plan gives each engine its device"),  # would beat the plan: every engine on GPU 0
    ("dp_size", 2, "placement plan gives each engine its device"),
    ("port", 30000, "free ports of its own"),
    ("load_format", "dummy", "dummy weights would serve the first generation unsynced")])
def test_server_args_the_placement_or_the_sync_own_are_refused(gsm8k_row_file, tmp_path, key, value, why):
    """ServerArgs fields that the placement plan, the ports or the weight sync decide pass the name check, yet break
    the run on GPUs (a duplicate `device` keyword, engines stacked on one GPU, a port collision, an unsynced first
    generation): refused at --cfg, naming the key as typed."""
    model = _model_dir(tmp_path / "qwen")
    cfg = compose_config([f"data.train_files={gsm8k_row_file}", f"model.path={model}",
                          f"rollout.engine_kwargs.sglang.{key}={value}"])
    with pytest.raises(ConfigValidationError, match=rf"rollout\.engine_kwargs\.sglang\.{key} cannot be set here \(.*"
                                                     rf"{why}"):
        validate_config(cfg)
