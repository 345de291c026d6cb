"""Early, clear errors for bad layouts and models; HF config -> megatron config mapping; launcher env."""
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, GPT2Config

from parallel.distributed import detect_launch_env, expand_slurm_nodelist
from parallel.model_config import (UnsupportedModelError, hf_model_spec, padded_vocab_size,
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


# ---------------------------------------------------------------- model families
from tests.support.model_families import FAMILY_MODELS  # noqa: E402


def family_config(kind, **kw):
    import transformers

    cls_name, base = FAMILY_MODELS[kind]
    return getattr(transformers, cls_name)(**{**dict(vocab_size=1000, hidden_size=64, num_attention_heads=4,
                                                      num_key_value_heads=2, num_hidden_layers=4), **base, **kw})


def test_family_specs_match_release_shapes():
    q3 = hf_model_spec(family_config("qwen3"))
    assert (q3.architecture, q3.qk_norm, q3.qkv_bias, q3.head_dim, q3.tie_word_embeddings) == \
        ("Qwen3ForCausalLM", True, False, 32, True)
    moe = hf_model_spec(family_config("qwen3_moe"))
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.moe_norm_topk_prob, moe.qk_norm) == \
        (8, 2, 32, True, True)
    mx = hf_model_spec(family_config("mixtral"))
    assert (mx.architecture, mx.num_experts, mx.moe_ffn_hidden_size, mx.moe_norm_topk_prob, mx.qk_norm) == \
        ("MixtralForCausalLM", 8, 48, True, False)
    l3 = hf_model_spec(family_config("llama3"))
    assert l3.rope_theta == 500000.0 and l3.rope_scaling["rope_type"] == "llama3" and l3.rope_scaling["factor"] == 32
    q25 = hf_model_spec(family_config("qwen2_5"))
    assert q25.qkv_bias and q25.rope_scaling is None and q25.rope_theta == 1e6


def test_moe_transformer_config_routing_and_aux_loss():
    cfg = transformer_config_from_hf(family_config("qwen3_moe"), ep=2)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.expert_model_parallel_size) == \
        (8, 2, 32, 2)
    assert not cfg.moe_router_pre_softmax and cfg.qk_layernorm and cfg.moe_aux_loss_coeff == 0.001
    # norm_topk_prob=False: top-k of the softmax over all experts (megatron's pre-softmax)
    cfg = transformer_config_from_hf(family_config("qwen3_moe", norm_topk_prob=False), moe_aux_loss_coeff=0.0)
    assert cfg.moe_router_pre_softmax and cfg.moe_aux_loss_coeff == 0 and cfg.moe_router_load_balancing_type == "none"


def test_moe_layout_refusals():
    spec = hf_model_spec(family_config("qwen3_moe"))
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=8"):
        validate_parallel_layout(spec, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="ep=2 needs a MoE model"):
        validate_parallel_layout(hf_model_spec(llama()), tp=1, pp=1, ep=2)
    with pytest.raises(ValueError, match="does not divide the experts' intermediate size 32"):
        validate_parallel_layout(spec, tp=1, pp=1, etp=3)
    with pytest.raises(UnsupportedModelError, match="every layer must be sparse"):
        hf_model_spec(family_config("qwen3_moe", mlp_only_layers=[0]))


def test_uneven_pipeline_for_real_layer_counts():
    for layers, pp, first, last in ((28, 4, 7, 7), (36, 8, 3, 3), (94, 8, 10, 12)):
        validate_parallel_layout(hf_model_spec(llama(num_hidden_layers=layers)), tp=1, pp=pp,
                                 num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    with pytest.raises(ValueError, match="pp=4 does not divide num_hidden_layers=30"):
        validate_parallel_layout(hf_model_spec(llama(num_hidden_layers=30)), tp=1, pp=4)
    with pytest.raises(ValueError, match="need pipeline parallelism"):
        validate_parallel_layout(hf_model_spec(llama()), tp=1, pp=1, num_layers_in_first_pipeline_stage=1)
    cfg = transformer_config_from_hf(llama(num_hidden_layers=6), pp=4, num_layers_in_first_pipeline_stage=1,
                                     num_layers_in_last_pipeline_stage=1)
    assert (cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage) == (1, 1)


@pytest.mark.parametrize("rope_type,match", [("dynamic", "sequence length"), ("yarn", "attention logits"),
                                             ("longrope", "LongRoPE"), ("su", "no megatron-core equivalent")])
def test_unsupported_rope_types_are_refused_with_the_list(rope_type, match):
    cfg = llama()
    cfg.rope_parameters = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match=f"{rope_type!r}.*{match}.*supported rope types: default, llama3, linear"):
        hf_model_spec(cfg)


@pytest.mark.parametrize("kind", ["llama3", "llama3_custom", "linear"])
def test_rope_frequencies_equal_transformers_bitwise(kind):
    """megatron's RotaryEmbedding (+ our override where megatron cannot express the config) gives
    exactly transformers' inverse frequencies."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from parallel.rope import apply_rope_scaling, gpt_rope_kwargs

    cfg = (family_config(kind) if kind != "linear"
           else llama(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}))
    spec = hf_model_spec(cfg)
    kw = gpt_rope_kwargs(spec)
    assert kw.get("rope_scaling", False) == (kind == "llama3")  # megatron's own option for Llama 3.x values

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=spec.head_dim, rotary_percent=1.0, rotary_base=kw["rotary_base"],
                rope_scaling=kw.get("rope_scaling", False), rope_scaling_factor=kw.get("rope_scaling_factor", 8.0),
                use_cpu_initialization=True)

    chunk = Chunk()
    apply_rope_scaling(chunk, cfg, spec)
    ref, attention_factor = ROPE_INIT_FUNCTIONS[spec.rope_scaling["rope_type"]](cfg, torch.device("cpu"))
    assert attention_factor == 1.0
    assert torch.equal(chunk.rotary_pos_emb.inv_freq, ref.float())
    default = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    assert not torch.equal(ref.float(), default)  # the scaling does change some frequencies


def test_preflight_from_config_json_alone(tmp_path):
    from parallel.preflight import check_model

    d = tmp_path / "qwen3"
    family_config("qwen3").save_pretrained(str(d))  # config.json only, no weights
    assert check_model(str(d), tp=2, pp=2).architecture == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        check_model(str(d), tp=4)
    g = tmp_path / "gpt2"
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(str(g))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        check_model(str(g))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model(str(tmp_path))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_cfg_accepts_each_family_from_its_config_json(tmp_path, kind, capsys):
    """`python -m rlhf.main recipe=quickstart model.path=<tiny Qwen3 dir> --cfg` exits 0 (config.json alone);
    DeepSeek-V3 too with the rollout engine on CPU (its CPU engine's prefill is corrected in
    rlhf/rollout/sglang_cpu: greedy tokens equal transformers', tests/e2e/test_family_sync_e2e.py)."""
    from rlhf.main import main

    family_config(kind).save_pretrained(str(tmp_path))
    assert main(["recipe=quickstart", f"model.path={tmp_path}", "--cfg"]) == 0, capsys.readouterr().err
    assert f"path: {tmp_path}" in capsys.readouterr().out


def test_cfg_refuses_an_unsupported_architecture_before_any_download(tmp_path, monkeypatch, capsys):
    """Exit 2 with the supported list, from config.json alone: a local directory without weights, and a hub
    name whose config.json alone is in the HF cache (offline: nothing is fetched)."""
    import huggingface_hub.constants as hub_constants

    from rlhf.main import main

    local = tmp_path / "gpt2"
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(str(local))
    snap = tmp_path / "hub" / "models--someorg--gpt2-like" / "snapshots" / "abc123"
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(str(snap))
    (tmp_path / "hub" / "models--someorg--gpt2-like" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--gpt2-like" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for ref in (str(local), "someorg/gpt2-like"):
        assert main(["recipe=quickstart", f"model.path={ref}", "--cfg"]) == 2
        err = capsys.readouterr().err
        assert f"model.path={ref!r}: unsupported architecture ['GPT2LMHeadModel']" in err, err
        assert ("supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, "
                "Qwen3MoeForCausalLM, MixtralForCausalLM") in err
    assert list(snap.iterdir()) == [snap / "config.json"]  # no weights were fetched


def test_uneven_pipeline_keys_reach_the_check_the_builder_and_the_planner(tmp_path, capsys, monkeypatch):
    """parallel.num_layers_in_first/last_pipeline_stage: 30 layers at PP4 are refused without them (naming
    them), accepted with 6 + 8 + 8 + 8; the trainer's model builder and the memory planner get them."""
    from rlhf.config import compose_config
    from rlhf.main import main
    from rlhf.memory_plan.from_config import plan_input_from_config
    from rlhf.workers import build

    family_config("qwen3", num_hidden_layers=30).save_pretrained(str(tmp_path))  # config.json only
    pp4 = ["recipe=quickstart", f"model.path={tmp_path}", "parallel.pipeline_model_parallel_size=4"]
    assert main(pp4 + ["--cfg"]) == 2
    assert "num_layers_in_first/last_pipeline_stage" in capsys.readouterr().err
    uneven = pp4 + ["parallel.num_layers_in_first_pipeline_stage=6"]
    assert main(uneven + ["--cfg"]) == 0, capsys.readouterr().err
    assert main(pp4 + ["parallel.num_layers_in_first_pipeline_stage=5", "--cfg"]) == 2  # 25 left for 3 stages
    assert "(first stage 5, last stage None)" in capsys.readouterr().err
    cfg = compose_config(uneven[1:] + ["parallel.num_layers_in_last_pipeline_stage=8", "model.moe_aux_loss_coef=0.01"],
                         recipe="quickstart")
    seen = {}
    monkeypatch.setattr(build, "build_model_chunks", lambda *a, **kw: seen.update(kw))
    build._chunks(cfg, family_config("qwen3", num_hidden_layers=30), "actor", str(tmp_path), cfg.actor)
    assert (seen["num_layers_in_first_pipeline_stage"], seen["num_layers_in_last_pipeline_stage"]) == (6, 8)
    assert seen["moe_aux_loss_coeff"] == 0.01
    inp = plan_input_from_config(cfg, family_config("qwen3", num_hidden_layers=30).to_dict(), world_size=4)
    assert (inp.layout.first_stage_layers, inp.layout.last_stage_layers) == (6, 8)


def test_verl_expert_parallel_key_maps_to_ours():
    """verl's actor_rollout_ref.actor.megatron.expert_model_parallel_size sets parallel.expert_model_parallel_size
    (the reference's must equal it)."""
    from rlhf.config import compose_config
    from rlhf.config import ConfigError

    c = compose_config(["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                        "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"], recipe="quickstart")
    assert c.parallel.expert_model_parallel_size == 2
    with pytest.raises(ConfigError, match="ref.megatron.expert_model_parallel_size=4 is not supported"):
        compose_config(["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                        "actor_rollout_ref.ref.megatron.expert_model_parallel_size=4"], recipe="quickstart")


def _dsv3(**kw):
    return family_config("deepseek_v3", **kw)


def test_deepseek_v3_spec_and_megatron_config():
    """DeepSeek-V3's HF fields land on megatron's MLA / MoE options (values from the tiny config
    shaped like the release: tests/support/model_families.py)."""
    spec = hf_model_spec(_dsv3())
    assert (spec.architecture, spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size,
            spec.moe_shared_ffn_hidden_size, spec.moe_dense_layers, spec.multi_latent_attention) == \
        ("DeepseekV3ForCausalLM", 8, 2, 32, 32, 1, True)
    cfg = transformer_config_from_hf(_dsv3(), tp=2, ep=2)
    assert type(cfg).__name__ == "MLATransformerConfig"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == \
        (32, 16, 16, 8, 16)
    assert (cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias, cfg.moe_router_bias_update_rate,
            cfg.moe_router_topk_scaling_factor, cfg.moe_router_num_groups, cfg.moe_router_group_topk) == \
        ("sigmoid", True, 0.0, 2.5, 2, 1)
    assert cfg.moe_layer_freq == [0, 1, 1, 1] and cfg.moe_shared_expert_intermediate_size == 32
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.original_max_position_embeddings, cfg.mscale,
            cfg.mscale_all_dim) == ("yarn", 40.0, 4096, 1.0, 1.0)
    plain = transformer_config_from_hf(_dsv3(rope_parameters={"rope_type": "default", "rope_theta": 5e4}))
    assert (plain.rope_type, plain.rotary_base) == ("rope", 5e4)
    # Moonlight-16B-A3B: one group, 64 experts top-6, 2 shared experts, no q LoRA
    moon = transformer_config_from_hf(_dsv3(n_group=1, topk_group=1, n_routed_experts=64, num_experts_per_tok=6,
                                            n_shared_experts=2, q_lora_rank=None))
    assert moon.moe_router_num_groups is None and moon.moe_shared_expert_intermediate_size == 64
    assert moon.q_lora_rank is None


@pytest.mark.parametrize("kw,match", [
    (dict(norm_topk_prob=False), "always renormalises"),
    (dict(num_experts_per_tok=4), "top-2 experts"),
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(quantization_config={"quant_method": "fp8"}), "dequantize it to bf16"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 1.2,
                           "original_max_position_embeddings": 64}), "attention_factor"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}), "rope_type='linear'"),
])
def test_deepseek_v3_refusals_name_the_value(kw, match):
    with pytest.raises(UnsupportedModelError, match=match):
        hf_model_spec(_dsv3(**kw))


def test_deepseek_v3_tp_must_divide_the_latent_projections():
    spec = hf_model_spec(_dsv3(kv_lora_rank=15))
    with pytest.raises(ValueError, match=r"tp=2 does not divide kv_lora_rank \+ qk_rope_head_dim=23"):
        validate_parallel_layout(spec, tp=2, pp=1)


@pytest.mark.parametrize("rope", [dict(mscale=1.0, mscale_all_dim=1.0), dict(mscale=0.707, mscale_all_dim=0.707),
                                  dict(mscale=1.0, mscale_all_dim=0.0), dict()])
def test_deepseek_v3_yarn_equals_transformers(rope):
    """megatron's MLA YaRN (frequencies, cos/sin concentration, softmax scale) from our mapping equals
    transformers' DeepSeek-V3 rotary embedding and attention scaling."""
    import math

    from parallel import cpu_patches

    cpu_patches.apply_cpu_patches()  # YaRN's get_emb moves its buffers to torch.cuda.current_device()
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding, _yarn_get_mscale
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "original_max_position_embeddings": 4096, **rope}
    hf_cfg = _dsv3(rope_parameters=params)
    m = transformer_config_from_hf(hf_cfg)
    yarn = YarnRotaryEmbedding(m.qk_pos_emb_head_dim, rotary_base=m.rotary_base, scaling_factor=m.rotary_scaling_factor,
                               original_max_position_embeddings=m.original_max_position_embeddings,
                               beta_fast=m.beta_fast, beta_slow=m.beta_slow, mscale=m.mscale,
                               mscale_all_dim=m.mscale_all_dim, use_cpu_initialization=True)
    emb, concentration = yarn(16)
    hf = DeepseekV3RotaryEmbedding(hf_cfg)
    cos, _ = hf(torch.zeros(1), torch.arange(16)[None])
    assert torch.allclose((emb.squeeze().cos() * concentration).float(), cos[0], atol=1e-6, rtol=0)
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    ours = _yarn_get_mscale(m.rotary_scaling_factor, m.mscale_all_dim) ** 2 / math.sqrt(q_head)
    assert ours == pytest.approx(yarn_apply_mscale(hf_cfg.rope_parameters, q_head ** -0.5), rel=1e-12)
