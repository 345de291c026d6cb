"""Early, clear errors for bad layouts and models; HF config -> megatron config mapping; launcher env."""
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, GPT2Config

from rlhf.mcore.distributed import detect_launch_env, expand_slurm_nodelist
from rlhf.mcore.model_config import (UnsupportedModelError, hf_model_spec, padded_vocab_size,
                                   transformer_config_from_hf, validate_parallel_layout)


def llama(**kw):
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)
    base.update(kw)
    return LlamaConfig(**base)


def test_spec_reads_llama_and_qwen2():
    spec = hf_model_spec(llama(rope_theta=500000.0) if False else llama())
    assert (spec.num_query_groups, spec.head_dim, spec.qkv_bias, spec.tie_word_embeddings) == (2, 16, False, False)
    q = hf_model_spec(Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    assert q.qkv_bias and q.tie_word_embeddings and q.architecture == "Qwen2ForCausalLM"


def test_rope_theta_from_config():
    cfg = llama()
    cfg.rope_parameters["rope_theta"] = 123456.0
    assert hf_model_spec(cfg).rope_theta == 123456.0


def test_transformer_config_matches_hf_numerics():
    cfg = transformer_config_from_hf(llama(rms_norm_eps=1e-6))
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.layernorm_epsilon == 1e-6 and cfg.num_query_groups == 2 and cfg.kv_channels == 16
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0


@pytest.mark.parametrize("tp,match", [(3, "num_attention_heads=4"), (4, "num_key_value_heads=2")])
def test_tp_must_divide_heads(tp, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_layout(hf_model_spec(llama()), tp=tp, pp=1)


def test_pp_must_divide_layers():
    with pytest.raises(ValueError, match="pp=3 does not divide num_hidden_layers=4"):
        validate_parallel_layout(hf_model_spec(llama()), tp=1, pp=3)
    with pytest.raises(ValueError, match="vpp=2"):
        validate_parallel_layout(hf_model_spec(llama(num_hidden_layers=6)), tp=1, pp=2, vpp=2)
    # uneven stages are fine when declared
    validate_parallel_layout(hf_model_spec(llama(num_hidden_layers=6)), tp=1, pp=4,
                             num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        hf_model_spec(GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        hf_model_spec(llama(hidden_act="gelu"))


def test_padded_vocab():
    assert padded_vocab_size(1000, 128, 1) == 1024
    assert padded_vocab_size(1000, 128, 2) == 1024
    assert padded_vocab_size(1025, 128, 2) == 1280
    assert padded_vocab_size(151936, 128, 8) == 152576


def test_slurm_nodelist_and_env():
    assert expand_slurm_nodelist("gpu-[01-03,07],cpu1") == ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu1"]
    assert expand_slurm_nodelist("node[8-10]") == ["node8", "node9", "node10"]
    env = detect_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                             "SLURM_JOB_NODELIST": "gpu-[03-04]", "MASTER_PORT": "12345"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (5, 16, 1, "gpu-03", 12345, "slurm")
    env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "9",
                             "SLURM_NTASKS": "16"})
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "torchrun")
    with pytest.raises(ValueError, match="unbalanced"):
        expand_slurm_nodelist("gpu-[01-03")
