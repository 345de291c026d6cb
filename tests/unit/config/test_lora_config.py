"""LoRA keys: ours (model.lora.*) and verl's (actor_rollout_ref.model.lora_rank / lora_alpha / target_modules and
its megatron lora.* section) compose to model.lora; bad values are named with the fix."""
from __future__ import annotations

import pytest

from rlhf.config import ConfigError, compose_config


def test_verl_lora_keys_compose_to_model_lora():
    cfg = compose_config(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
                          "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                          "actor_rollout_ref.model.lora.rank=0",  # verl's megatron default: keeps lora_rank
                          "actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
                          "actor_rollout_ref.model.lora.merge=true", "actor_rollout_ref.model.lora.dropout=0.0"])
    lora = cfg.model.lora
    assert (lora.rank, lora.alpha, list(lora.target_modules), lora.a_init, lora.merge) == (
        8, 32.0, ["q_proj", "k_proj", "v_proj", "o_proj"], "kaiming", True)
    assert compose_config([]).model.lora.rank == 0  # off by default
    assert compose_config([]).model.lora.merge is False  # verl's default: the engines get the adapters


def test_adapter_mode_starts_engines_with_lora():
    """lora.merge=false: the engines start with SGLang's LoRA for the actor's rank and (PEFT) target modules;
    merge=true or no LoRA: no LoRA arguments (merged or full weights)."""
    from rlhf.workers.rollout import rollout_engine_config

    def overrides(*args):
        return rollout_engine_config(compose_config(list(args)), "/m", "cpu")["engine_overrides"]

    assert overrides("model.lora.rank=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,down_proj]") == {
        "enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["down_proj", "k_proj", "q_proj", "v_proj"]}
    assert overrides("model.lora.rank=8", "actor_rollout_ref.model.lora.merge=true") == {}
    assert overrides() == {}


def test_bad_lora_settings_are_named():
    bad = ["model.lora.rank=4", "model.lora.target_modules=[q_proj,o_proj]", "actor_rollout_ref.model.lora.dropout=0.1",
           "critic.model.lora_rank=4"]
    with pytest.raises(ConfigError) as ei:
        compose_config(bad)
    msg = str(ei.value)
    for s in ["'q_proj' without ['k_proj', 'v_proj']", "list all of them", "lora.dropout=0.1 is not supported",
              "LoRA on the critic is not supported"]:
        assert s in msg, f"{s!r} not in\n{msg}"
