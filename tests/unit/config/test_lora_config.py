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


def test_moe_expert_adapters_fall_back_to_merged_sync(tmp_path, caplog):
    """merge=false on a MoE model: expert targets (gate/up/down_proj, all-linear) make every sync send merged
    weights (SGLang 0.5.23's MoE LoRA is CUDA/Triton only), logged once and flagged in the sync metrics; attention
    targets alone still go as adapters."""
    import logging

    from transformers import Qwen3MoeConfig

    from rlhf.weight_bridge.bridge import SyncStats
    from rlhf.workers import lora_reference
    from rlhf.workers.rollout import rollout_engine_config

    Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)
    lora_reference._logged_fallback = False
    experts = compose_config(["model.lora.rank=8", "model.lora.target_modules=all-linear"])
    attention = compose_config(["model.lora.rank=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    with caplog.at_level(logging.WARNING, logger=lora_reference.__name__):
        assert lora_reference.adapter_sync_settings(experts, str(tmp_path)) == (None, True)
        assert rollout_engine_config(experts, str(tmp_path), "cpu")["engine_overrides"] == {}
    assert sum("MoE experts" in r.getMessage() for r in caplog.records) == 1  # logged once
    settings, fallback = lora_reference.adapter_sync_settings(attention, str(tmp_path))
    assert settings.targets == ("linear_qkv", "linear_proj") and not fallback
    assert rollout_engine_config(attention, str(tmp_path), "cpu")["engine_overrides"]["enable_lora"] is True
    assert lora_reference.adapter_sync_settings(experts, "/no/such/dense/model") == (
        lora_reference.lora_settings(experts), False)
    assert SyncStats(bytes=10, lora_merged_fallback=True).metrics()["weight_sync/lora_merged_fallback"] == 1.0
    assert "weight_sync/lora_merged_fallback" not in SyncStats(bytes=10).metrics()
