"""Memory planner (rlhf/memory_plan/) against hand-computed numbers; the Qwen2-7B recipes on 80 GiB GPUs."""
import pytest

from rlhf.memory_plan.planner import (EngineSetup, GiB, Item, Layout, PlanInput, Role, Workload, format_plan,
                                    plan_memory)
from rlhf.memory_plan.from_config import MemoryPlanError, check_memory_plan, plan_from_config
from rlhf.memory_plan.terms import (ModelShape, in_flight_micro_batches, kv_bytes_per_token, layer_activations,
                                          logits_bytes, model_params, stage_layers, stage_params)

# Qwen2-7B-Instruct's config.json (the real values; no download needed)
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}

# small model: vocab 1000 (padded to 1024 at tp 2), h 64, f 256, 4 layers, 8 heads of 8, 2 KV groups, untied
SMALL = ModelShape(vocab_size=1000, hidden_size=64, ffn_hidden_size=256, num_layers=4, num_attention_heads=8,
                   num_kv_heads=2, head_dim=8)


def test_small_params_per_rank_by_hand():
    # one layer at tp 2: qkv 64 x (8 + 2*2) * 8 = 6144, proj 64 x 64 = 4096 -> (6144 + 4096) / 2 = 5120;
    # 2 norms of 64 = 128; SwiGLU 3 x 64 x 256 / 2 = 24576
    layer = 5120 + 128 + 24576
    embed = 1024 * 64 // 2
    assert stage_params(SMALL, 2, 4, True, True) == (4 * layer + embed + 64 + embed, 0)
    assert stage_params(SMALL, 2, 4, True, True, value_head=True) == (4 * layer + embed + 64 + 64, 0)
    # pp 2: stage 0 has the embedding, stage 1 the final norm and the head
    assert stage_params(SMALL, 2, 2, True, False, pp=2)[0] == 2 * layer + embed
    assert stage_params(SMALL, 2, 2, False, True, pp=2)[0] == 2 * layer + 64 + embed
    tied = ModelShape(**{**SMALL.__dict__, "tie_word_embeddings": True})
    assert stage_params(tied, 2, 4, True, True)[0] == 4 * layer + embed + 64  # one shared matrix
    assert stage_params(tied, 2, 2, False, True, pp=2)[0] == 2 * layer + 64 + embed  # the last stage's replica
    assert model_params(SMALL) == 4 * (6144 + 4096 + 128 + 3 * 64 * 256) + 2 * 1000 * 64 + 64


def test_qwen2_7b_parameter_count_is_7_6b():
    m = ModelShape.from_hf_config(QWEN2_7B)
    assert (m.qkv_bias, m.head_dim, m.num_kv_heads) == (True, 128, 4)
    assert model_params(m) == pytest.approx(7.6156e9, rel=1e-4)  # Qwen2-7B: 7.62B parameters


def test_small_activations_by_hand():
    """seq 32, micro batch 2 (x = 64 tokens), tp 2 with SP, bf16, megatron's local spec."""
    a = layer_activations(SMALL, 32, 2, 2, sequence_parallel=True, act_bytes=2, flash_attention=False, recompute=None)
    norms = 2 * 8 * 64 * 64 / 2 + 2 * 2 * 64 * 64 / 2  # fp32 RMSNorm copies + QKV / fc1 inputs, SP-sharded
    attn = 2 * 64 * 8 * (4 * 4)  # q, expanded k and v, context: 4 heads per rank, head dim 8
    scores = 2 * 4 * 32 * 32 * (4 + 2) + 32 * 32  # fp32 softmax + bf16 probabilities, causal mask
    mlp = 5 * 2 * 64 * 256 / 2
    assert a.stored == a.full_layer == norms + attn + scores + mlp == 189440
    assert a.backward_transient == max(4 * 2 * 4 * 32 * 32, 2 * 2 * 64 * 256 / 2) + 2 * 64 * 64 / 2
    fused = layer_activations(SMALL, 32, 2, 2, sequence_parallel=True, act_bytes=2, flash_attention=False,
                              recompute=None, fused_norm=True)  # CUDA: torch's fused RMSNorm keeps input + 1/rms
    assert fused.stored == 2 * (2 * 64 * 64 + 4 * 64) / 2 + 2 * 2 * 64 * 64 / 2 + attn + scores + mlp == 165120
    full = layer_activations(SMALL, 32, 2, 2, sequence_parallel=True, act_bytes=2, flash_attention=False,
                             recompute="full")
    assert full.stored == 2 * 64 * 64 / 2  # only the layer input
    sel = layer_activations(SMALL, 32, 2, 2, sequence_parallel=True, act_bytes=2, flash_attention=False,
                            recompute="selective")
    assert sel.stored == norms + 2 * 64 * 8 * (3 * 4 + 3 * 1) + mlp  # no s x s terms
    swiglu = layer_activations(SMALL, 32, 2, 2, sequence_parallel=True, act_bytes=2, flash_attention=False,
                               recompute=None, fused_swiglu=True)  # fc1 output + the fc2 input only
    assert swiglu.stored == norms + attn + scores + 3 * 2 * 64 * 256 / 2
    te = layer_activations(SMALL, 32, 2, 2, sequence_parallel=True, act_bytes=2, flash_attention=True, recompute=None)
    assert te.stored == 4 * 2 * 64 * 64 / 2 + 2 * 64 * 8 * (2 * 4 + 2 * 1) + 4 * 2 * 4 * 32 + 3 * 2 * 64 * 256 / 2
    with pytest.raises(ValueError, match="recompute='some'"):
        layer_activations(SMALL, 32, 2, 2, sequence_parallel=True, act_bytes=2, flash_attention=True, recompute="some")


def test_logits_bytes_by_hand():
    # 64 tokens x 1024 / 2 vocab per rank; bf16: logits 2 + fp32 copy 4 + shifted 4 + exp 4 + mask fill 4
    # (1000 < 1024); entropy + 8
    assert logits_bytes(SMALL, 64, 2, act_bytes=2, entropy=False) == 64 * 512 * 18
    assert logits_bytes(SMALL, 64, 2, act_bytes=2, entropy=True) == 64 * 512 * 26
    even = ModelShape(**{**SMALL.__dict__, "vocab_size": 1024})
    assert logits_bytes(even, 64, 2, act_bytes=4, entropy=False, temperature=0.7) == 64 * 512 * (4 + 8 + 4)
    # no grad (parallel.logprobs slices the batch): the logits whole, the temporaries on one slice of whole sequences
    # of at most 2**25 logits: 64 sequences x 100 tokens x 32000 (fp32, TP1) -> slices of 10 sequences
    v32k = ModelShape(**{**SMALL.__dict__, "vocab_size": 32000})
    row = 100 * 32000
    assert logits_bytes(v32k, 6400, 1, act_bytes=4, entropy=False, no_grad_seq=100) == 6400 * 32000 * 4 + 10 * row * 8
    assert logits_bytes(v32k, 6400, 1, act_bytes=4, entropy=False) == 6400 * 32000 * 12
    # small logits: one piece, the same as with autograd
    assert logits_bytes(SMALL, 64, 2, act_bytes=2, entropy=False, no_grad_seq=16) == 64 * 512 * 18


def test_pipeline_helpers():
    assert stage_layers(28, 4) == [7, 7, 7, 7] and stage_layers(30, 4, first=6, last=6) == [6, 9, 9, 6]
    assert [in_flight_micro_batches(4, k, 8) for k in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches(4, 0, 2) == 2  # fewer micro batches than stages
    assert in_flight_micro_batches(2, 0, 8, vpp=2) == (1 * 2 + 1 * 2 + 1) / 2
    assert kv_bytes_per_token(ModelShape.from_hf_config(QWEN2_7B), 2) == 2 * 28 * 2 * 128 * 2


def small_input(**kw):
    base = dict(model=SMALL, layout=Layout(tp=2, pp=1, dp=2, sequence_parallel=True),
                roles=(Role("actor", distributed_optimizer=True, micro_batch=2, num_micro_batches=2),
                       Role("reference", trainable=False)),
                workload=Workload(seq_length=31, log_prob_micro_batch=4), gpu_bytes=1 * GiB, num_gpus=4,
                engine=EngineSetup(tp=2, num_engines=2, mem_fraction_static=0.5, runtime_bytes=1 << 20,
                                   sync_bucket_bytes=1 << 20),
                params_bytes=2, recompute=None, flash_attention=False, fused_adam=False, fused_swiglu=False,
                cuda_context_bytes=100 << 20, nccl_comm_bytes=50 << 20, nccl_pair_comm_bytes=40 << 20)
    base.update(kw)
    return PlanInput(**base)


def test_small_plan_phases_by_hand():
    plan = plan_memory(small_input())
    p = 4 * (5120 + 128 + 24576) + 512 * 64 + 64 + 512 * 64  # actor elements per rank (seq 31 pads to 32 at tp 2)
    weights, grads, main, adam = 2 * p, 4 * p, 4 * p / 2, 8 * p / 2  # bf16, fp32 grads, distributed optimizer
    ref = 2 * p
    ctx = (100 << 20) + (50 << 20)  # the CUDA context + the world's communicator (4 ranks), at the engine's start
    # from the first step: the TP, DP x CP and DP groups (2 ranks each) and the distributed optimizer's grad-norm
    # group (4 ranks); the weight sync's holders (ranks 0..3) broadcast on the world group
    comms = 3 * (40 << 20) + (50 << 20)
    build = plan.phase("build")
    assert build.peak == ctx + weights + grads + main + ref
    free = 1 * GiB - build.peak - (100 << 20)  # minus the engine's own context
    assert plan.engine_free_at_start == free and plan.engine_static == 0.5 * free
    assert plan.kv_cache_bytes == 0.5 * free - model_params(SMALL) * 2 / 2
    assert plan.kv_cache_tokens == plan.kv_cache_bytes / (2 * 4 * 1 * 8 * 2)
    engine = (100 << 20) + 0.5 * free + (1 << 20)
    assert plan.phase("generate").peak == build.peak + adam + engine + comms
    assert plan.max_mem_fraction_static == 1 - (adam + (1 << 20) + comms) / free
    released = (100 << 20) + (1 << 20)  # engine context + its runtime pool stay while released
    layer = 165120  # test_small_activations_by_hand, CUDA's fused RMSNorm
    logits = 64 * 512 * 26  # micro batch 2 x 32 tokens, with entropy
    final_norm = (2 + 2) * 64 * 64 / 2  # final norm input + LM head input, SP-sharded
    fwd_bwd = plan.phase("actor fwd/bwd")
    assert fwd_bwd.peak == build.peak + comms + adam + released + 4 * layer + max(final_norm + logits, 0)
    assert fwd_bwd.torch_peak == weights + grads + main + ref + adam + 4 * layer + final_norm + logits
    lp = plan.phase("actor log-probs")  # micro batch 4 x 32 tokens, no entropy, no autograd
    assert lp.peak == build.peak + comms + adam + released + max(128 * 512 * 18,
                                                                 12 * 4 * 4 * 32 * 32 + 2 * 2 * 128 * 64 / 2)
    # torch Adam (foreach): one fp32 temporary per optimizer parameter + the clip's copy of the largest tensor
    step = plan.phase("actor optimizer step")
    assert step.peak == build.peak + comms + adam + released + 4 * p / 2 + 4 * (512 * 64)
    assert plan.fits and "fits" in format_plan(plan)


def test_checkpoint_save_phase_by_hand():
    """megatron-core 0.16.1's fully_reshardable save (DistributedOptimizer.get_parameter_state_dp_zero with
    return_on_all_ranks): per state (param, exp_avg, exp_avg_sq) in turn, the rank's fp32 shard copied to the GPU
    plus the dp shards all-gathered there (the whole grad buffer): 4 x p x (1 + 1/dp) bytes at dp 2 = 6 p.  The
    colocated engines are released around the save (their context and runtime pool stay); without that release
    they keep mem_fraction_static x free (the 7B recipes: test_ppo_7b_save_fits_only_with_the_engines_released)."""
    plan = plan_memory(small_input())
    p = 4 * (5120 + 128 + 24576) + 512 * 64 + 64 + 512 * 64  # actor elements per rank, as above
    weights, grads, main, adam, ref = 2 * p, 4 * p, 4 * p / 2, 8 * p / 2, 2 * p
    comms_all = (100 << 20) + (50 << 20) + 3 * (40 << 20) + (50 << 20)  # context + every communicator
    released = (100 << 20) + (1 << 20)
    gather = 4 * p * (1 + 1 / 2)
    save = plan.phase("checkpoint save")
    assert save.peak == comms_all + weights + grads + main + ref + adam + released + gather
    items = {i.name: i.bytes for i in save.items}
    assert items["actor distributed-optimizer state gathered over DP (fp32, one state at a time)"] == 6 * p
    assert save.torch_peak == weights + grads + main + ref + adam + gather
    held = plan_memory(small_input(engine=EngineSetup(tp=2, num_engines=2, mem_fraction_static=0.5,
                                                      runtime_bytes=1 << 20, sync_bucket_bytes=1 << 20,
                                                      release_for_save=False)))
    engine = (100 << 20) + plan.engine_static + (1 << 20)
    assert held.phase("checkpoint save").peak == save.peak - released + engine
    assert "release the engines around the save" in held.phase("checkpoint save").knob
    # no gather without the distributed optimizer, nor at DP 1
    plain = plan_memory(small_input(roles=(Role("actor", micro_batch=2, num_micro_batches=2),)))
    assert not any("gathered" in i.name for i in plain.phase("checkpoint save").items)
    dp1 = plan_memory(small_input(layout=Layout(tp=2, pp=2, dp=1, sequence_parallel=True)))
    assert not any("gathered" in i.name for i in dp1.phase("checkpoint save").items)


def test_weight_sync_memory_per_gpu():
    """The leader's GPU holds its pool plus a gathered/converted parameter (2 x bucket), every other engine GPU one
    copy of the pool (engine-local handles, every pipeline stage's buckets), and no engine process opens a context
    on a leader's GPU, at PP 1 and PP 2, and with expert parallelism (before: no holders under EP, the engines mapped
    the stage leaders' buckets, one CUDA context per other engine rank on a leader's GPU, and no copy)."""
    for layout in (Layout(tp=2, pp=1, dp=2, sequence_parallel=True), Layout(tp=2, pp=2, dp=1, sequence_parallel=True),
                   Layout(tp=1, pp=1, dp=4, ep=2)):
        plan = plan_memory(small_input(layout=layout))
        items = {i.name: i.bytes for i in plan.phase("weight sync").items}
        assert items["weight sync buckets on the stage leader's GPU (gathered + packed)"] == 2 * (1 << 20)
        assert plan.sync_copy_bytes == 1 << 20 and not any("contexts on the stage leader" in n for n in items)


def test_small_plan_refusals_and_knobs():
    # the engine takes 99.9 % of the free memory at start: its runtime pool, then Adam's moments do not fit
    tight = plan_memory(small_input(engine=EngineSetup(tp=2, num_engines=2, mem_fraction_static=0.999,
                                                       runtime_bytes=1 << 20, sync_bucket_bytes=1 << 20)))
    assert not tight.fits and [k.split(":")[0] for k in tight.knobs()] == ["engine start", "generate"]
    text = format_plan(tight)
    assert "DOES NOT FIT" in text and "generate" in text and "mem_fraction_static" in text
    with pytest.raises(MemoryPlanError, match="lower rollout.mem_fraction_static"):
        check_memory_plan(tight)
    assert check_memory_plan(tight, strict=False) is tight
    crowded = plan_memory(small_input(engine=EngineSetup(tp=2, num_engines=4)))
    assert any("engine ranks per GPU" in p for p in crowded.problems) and not crowded.fits
    no_kv = plan_memory(small_input(engine=EngineSetup(tp=2, num_engines=2, mem_fraction_static=0.0001)))
    assert any("engine weights" in p for p in no_kv.problems)
    # without the memory saver the engine keeps its share through the trainer's phases
    kept = plan_memory(small_input(engine=EngineSetup(tp=2, num_engines=2, memory_saver=False, runtime_bytes=1 << 20)))
    assert kept.phase("actor fwd/bwd").peak > plan_memory(small_input()).phase("actor fwd/bwd").peak
    assert "enable_memory_saver" in kept.phase("actor fwd/bwd").knob


def test_phase_items_and_item_flags():
    plan = plan_memory(small_input())
    names = [p.name for p in plan.phases]
    assert names == ["build", "engine start", "generate", "weight sync", "actor log-probs", "reference log-probs",
                     "actor fwd/bwd", "actor optimizer step", "checkpoint save"]
    assert all(isinstance(i, Item) for p in plan.phases for i in p.items)
    assert plan.peak.name in names


# ------------------------------------------------------------------ the Qwen2-7B recipes on 80 GiB GPUs

RECIPES = ["gsm8k_ppo_qwen2_7b", "grpo_qwen2_7b", "dapo_qwen2_7b", "dpo_qwen2_7b"]


@pytest.fixture(scope="module")
def recipe_cfgs():
    from rlhf.config import compose_config

    return {r: compose_config([], recipe=r) for r in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES)
def test_qwen2_7b_recipes_fit_80gb_with_the_engine_released(recipe_cfgs, recipe):
    plan = plan_from_config(recipe_cfgs[recipe], QWEN2_7B, world_size=8, gpu_memory_gib=80)
    assert plan.fits, format_plan(plan)
    assert plan.peak.peak < 75 * GiB  # at least 5 GiB of headroom in every phase


def test_ppo_7b_numbers(recipe_cfgs):
    """PPO: actor + critic + reference at TP4 x DP2; the engine's share is fixed before Adam's moments exist."""
    plan = plan_from_config(recipe_cfgs["gsm8k_ppo_qwen2_7b"], QWEN2_7B, world_size=8)
    # NCCL: the world's communicator (688 MiB) at the start; from the first step TP4, DP x CP 2, DP 2 and the
    # distributed optimizer's grad-norm group (8): 688 + 544 + 544 + 688 MiB = 2.41 GiB after the engine's start
    assert plan.phase("build").peak / GiB == pytest.approx(32.3, abs=0.1)
    assert plan.engine_free_at_start / GiB == pytest.approx(46.9, abs=0.1)
    assert plan.phase("generate").peak / GiB == pytest.approx(74.6, abs=0.1)
    assert plan.max_mem_fraction_static == pytest.approx(0.61, abs=0.01)
    assert plan.kv_cache_tokens == pytest.approx(613e3, rel=0.01)


def test_ppo_7b_save_fits_only_with_the_engines_released(recipe_cfgs):
    """gsm8k_ppo_qwen2_7b on 8 x 80 GiB (TP4 x DP2, distributed optimizer): the save gathers the actor's TP4 shard
    (1,904,057,344 elements: the critic's, with a value head for the LM head, is smaller) in fp32 over DP 2:
    4 x 1.904e9 x 1.5 bytes = 10.64 GiB, on top of everything resident after a step (51.2 GiB: the optimizer step's
    phase, the engines released: their context and runtime pool) = 61.8 GiB.  Holding the engines' mem_fraction_static share (23.5 GiB) it
    would need 85.3 GiB."""
    from dataclasses import replace

    from rlhf.memory_plan.from_config import plan_input_from_config

    inp = plan_input_from_config(recipe_cfgs["gsm8k_ppo_qwen2_7b"], QWEN2_7B, world_size=8)
    plan = plan_memory(inp)
    save = plan.phase("checkpoint save")
    gathered = [i.bytes for i in save.items if "gathered over DP" in i.name]
    assert gathered == [4 * 1904057344 * 1.5]
    # the optimizer step's resident state (no Adam temporaries: fused Adam) + the gather
    assert save.peak == plan.phase("actor optimizer step").peak + gathered[0]
    assert save.peak / GiB == pytest.approx(61.8, abs=0.05) and plan.fits
    held = plan_memory(replace(inp, engine=replace(inp.engine, release_for_save=False)))
    assert held.phase("checkpoint save").peak == save.peak + plan.engine_static  # weights + KV cache kept
    assert held.phase("checkpoint save").peak / GiB == pytest.approx(85.3, abs=0.05) and not held.fits
    assert [k.split(":")[0] for k in held.knobs()] == ["checkpoint save"]


@pytest.mark.parametrize("recipe", RECIPES[:3])
def test_rl_recipes_oom_without_memory_saver_or_empty_cache(recipe_cfgs, recipe):
    """Today's engine (no memory saver) keeps its share while the trainer computes: the actor update OOMs (the
    log-probs, computed without autograd in slices of the batch, no longer do); and without empty_cache the
    trainer's cached blocks stay while generating."""
    no_saver = plan_from_config(recipe_cfgs[recipe], QWEN2_7B, world_size=8, engine_memory_saver=False)
    assert no_saver.phase("actor fwd/bwd").peak > 80 * GiB and not no_saver.fits
    cached = plan_from_config(recipe_cfgs[recipe], QWEN2_7B, world_size=8, trainer_empty_cache=False)
    assert not cached.fits and "empty_cache" in cached.phase("generate").knob


def test_dpo_has_no_engine_phases(recipe_cfgs):
    plan = plan_from_config(recipe_cfgs["dpo_qwen2_7b"], QWEN2_7B, world_size=8)
    assert [p.name for p in plan.phases] == ["build", "actor log-probs", "reference log-probs", "actor fwd/bwd",
                                             "actor optimizer step", "checkpoint save"]
    assert plan.engine_static is None


def test_plan_from_config_reads_a_plain_dict_and_checks_world_size():
    cfg = {"parallel": {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1},
           "data": {"max_prompt_length": 512, "max_response_length": 512, "train_batch_size": 64},
           "algorithm": {"name": "grpo", "adv_estimator": "grpo"}, "rollout": {"n": 4, "num_engines": 4,
                                                                               "tensor_model_parallel_size": 2},
           "model": {"dtype": "bfloat16"}}
    plan = plan_from_config(cfg, QWEN2_7B, world_size=8)
    assert [p.name for p in plan.phases][:3] == ["build", "engine start", "generate"]
    with pytest.raises(ValueError, match="does not divide world_size=6"):
        plan_from_config(cfg, QWEN2_7B, world_size=6)


# DeepSeek-V3's config.json (the released values that size the model; no download needed)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "tie_word_embeddings": False, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 163840, "hidden_act": "silu",
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, "rope_theta": 10000,
}


def test_deepseek_v3_parameters_and_mla_kv_cache_by_hand():
    m = ModelShape.from_hf_config(DEEPSEEK_V3)
    assert (m.mla, m.dense_layers, m.shared_ffn_hidden_size, m.num_experts) == (True, 3, 2048, 256)
    assert model_params(m) == pytest.approx(671.03e9, rel=1e-4)  # DeepSeek-V3: 671B (without the MTP layer)
    # MLA caches the 512-dim latent and the 64-dim rope key per token and layer, on every engine TP rank
    assert kv_bytes_per_token(m, engine_tp=8, kv_bytes=2) == 61 * (512 + 64) * 2
    # one MLA attention at tp 8: q 7168 x 1536 + 1536 x 128 x 192, kv 7168 x 576 + 512 x 128 x 256, o 16384 x 7168
    attn = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168) / 8 + 1536 + 512
    moe_layer = attn + 2 * 7168 + 256 * 7168 + 256 + 3 * 7168 * 2048 / 8
    dense_layer = attn + 2 * 7168 + 3 * 7168 * 18432 / 8
    # pp 2 stage 0 of 31 layers: 3 dense + 28 MoE layers and the embedding; ep 8: 32 experts per rank
    embed = 130048 * 7168 / 8  # vocab padded to a multiple of 128 x 8
    got = stage_params(m, 8, 31, True, False, pp=2, ep=8, dense_mlp_layers=3)
    assert got == pytest.approx((3 * dense_layer + 28 * moe_layer + embed, 28 * 32 * 3 * 7168 * 2048 / 8), rel=1e-12)


def test_plan_from_config_reads_the_deepseek_v3_config_json():
    cfg = {"parallel": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 16,
                        "expert_model_parallel_size": 8},
           "data": {"max_prompt_length": 512, "max_response_length": 512, "train_batch_size": 128},
           "algorithm": {"name": "grpo", "adv_estimator": "grpo"},
           "rollout": {"n": 4, "num_engines": 8, "tensor_model_parallel_size": 16, "mem_fraction_static": 0.85},
           "model": {"dtype": "bfloat16"}}
    plan = plan_from_config(cfg, DEEPSEEK_V3, world_size=128, gpu_memory_gib=141)
    assert plan.kv_cache_bytes > 0, format_plan(plan)
    assert [p.name for p in plan.phases][:3] == ["build", "engine start", "generate"]
    assert plan.kv_cache_tokens == pytest.approx(plan.kv_cache_bytes / (61 * 576 * 2))


# on-policy distillation's teacher: 6 layers, h 128, f 512, 8 heads of 16, 2 KV groups, untied, vocab 1000
TEACHER = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 512,
           "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
           "tie_word_embeddings": False}
STUDENT = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}


def _distill_cfg(**teacher):
    return {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
            "data": {"max_prompt_length": 16, "max_response_length": 16, "train_batch_size": 8},
            "algorithm": {"name": "grpo", "adv_estimator": "grpo"}, "rollout": {"n": 2, "num_engines": 4},
            "model": {"dtype": "bfloat16"}, "distill": {"enable": True, "teacher": {"path": "/t", **teacher}}}


def _item(phase, name):
    return sum(i.bytes for i in phase.items if i.name == name)


def test_the_teacher_weights_in_the_plan_by_hand():
    # tp 2: qkv 128 x (8 + 2*2) * 16 = 24576, proj 128 x 128 = 16384 -> 20480; norms 256; SwiGLU 3 x 128 x 512 / 2
    layer_tp2 = (24576 + 16384) // 2 + 256 + 3 * 128 * 512 // 2
    embed_tp2 = 1024 * 128 // 2  # vocab 1000 padded to 128 x tp
    tp2 = plan_from_config(_distill_cfg(tensor_model_parallel_size=2), STUDENT, world_size=4,
                           teacher_hf_config=TEACHER)
    want = 2 * (6 * layer_tp2 + embed_tp2 + 128 + embed_tp2)  # bf16: embedding, final norm, untied head
    assert _item(tp2.phase("build"), "teacher weights") == want == 2 * 845440
    plain = dict(_distill_cfg(), distill={"enable": False})  # the same run without distillation
    assert tp2.phase("build").peak - plan_from_config(plain, STUDENT, world_size=4).phase("build").peak == want
    # pp 2 on its own grid (the trainer: tp 1, pp 1): 3 layers a stage, the worst (last: norm + head) on every rank
    layer = 24576 + 16384 + 256 + 3 * 128 * 512
    pp2 = plan_from_config(_distill_cfg(pipeline_model_parallel_size=2), STUDENT, world_size=4,
                           teacher_hf_config=TEACHER)
    assert _item(pp2.phase("build"), "teacher weights") == 2 * (3 * layer + 128 + 1024 * 128)
    # the trainer's grid (null sizes): the whole teacher on every rank
    same = plan_from_config(_distill_cfg(), STUDENT, world_size=4, teacher_hf_config=TEACHER)
    assert _item(same.phase("build"), "teacher weights") == 2 * (6 * layer + 2 * 1024 * 128 + 128)
    assert "teacher log-probs" in [p.name for p in same.phases] and "teacher" in same.summary
    # offloaded between its forwards: only its own phase holds it
    offl = plan_from_config(_distill_cfg(tensor_model_parallel_size=2, param_offload=True), STUDENT, world_size=4,
                            teacher_hf_config=TEACHER)
    assert _item(offl.phase("build"), "teacher weights") == 0
    assert _item(offl.phase("teacher log-probs"), "teacher weights (loaded from host)") == want
    assert _item(offl.phase("actor log-probs"), "teacher weights (loaded from host)") == 0
    with pytest.raises(ValueError, match="the teacher's config.json \\(distill.teacher.path='/t'\\)"):
        plan_from_config(_distill_cfg(), STUDENT, world_size=4)
    with pytest.raises(ValueError, match="distill.teacher: tp=3 x pp=1 does not divide world_size=4"):
        plan_from_config(_distill_cfg(tensor_model_parallel_size=3), STUDENT, world_size=4, teacher_hf_config=TEACHER)
