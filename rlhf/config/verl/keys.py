"""verl's config keys and what each means here: the table behind :mod:`rlhf.config.verl.compat`.

Every rule is ``(pattern, action, arg)``; patterns are dotted keys where ``*`` matches one part (``muon_*`` a part
starting so) and a trailing ``**`` any rest (also nothing).  The first matching rule wins.  Actions:

    map        rename to our key ``arg``
    prefix     replace the matched prefix (the pattern without ``.**``) by ``arg``; the result must be a key of
               our schema
    fn         ``arg(value) -> [(our key, value), ...]``; raises :class:`Unsupported` for a value we cannot honour
    same       accepted when equal to our key ``arg`` after composing (the reference / critic share the actor's
               parallel layout)
    neutral    ``arg = (values, why)``: accepted only at one of ``values`` (the feature switched off)
    ignore     ``arg = why``: accepted, no effect here (an engine or throughput knob, or done automatically)
    refuse     ``arg = why``: not supported at any value (a feature with no equivalent here)

A config file's value equal to verl's own default for a key that must agree with another setting reads as
"not set" (:data:`~rlhf.config.verl.megatron_keys.VERL_DEFAULTS`); when a key is given more than once (a config
file, then the command line) the last one counts.  Keys of our own schema are used as they are (``data.train_batch_size``); rules marked by :data:`OURS` apply
to them too (a one-name ``trainer.logger``).  The table names verl's keys; it holds no verl code or YAML.
"""
from __future__ import annotations

from typing import Any, Callable

from rlhf.config.verl.megatron_keys import MEGATRON_DTYPES, Unsupported, dtype_rule, megatron_rules, optimizer_rules

__all__ = ["Unsupported", "RULES", "OURS", "REWARD_MODEL_PREFIX"]


REWARD_MODEL_PREFIX = "reward_model."
_OFF = (False, None, 0, "", {}, [])
# verl seeds the mini-batch permutation of <role>.shuffle with data_loader_seed (the same permutation every step);
# here it is seeded by the step, so a resumed run visits the rows as the uninterrupted one
_SHUFFLE_SEED = "the mini-batch permutation (actor.shuffle / critic.shuffle) is seeded by the training step"


def _logger(v: Any) -> list[tuple[str, Any]]:
    return [("trainer.logger", [v] if isinstance(v, str) else list(v))]


def _rollout_name(v: Any) -> list[tuple[str, Any]]:
    if v in ("sglang", "vllm"):  # both serve the same sampling; SGLang is the engine here
        return [("rollout.name", "sglang")]
    raise Unsupported("the rollout engine here is SGLang; use rollout.name=sglang (vllm is read as sglang)")


def _betas(prefix: str) -> Callable[[Any], list]:
    def fn(v: Any) -> list[tuple[str, Any]]:
        b1, b2 = list(v)
        return [(f"{prefix}.adam_beta1", b1), (f"{prefix}.adam_beta2", b2)]
    return fn


def _warmup_steps(prefix: str) -> Callable[[Any], list]:
    def fn(v: Any) -> list[tuple[str, Any]]:
        return [] if v is None or v == -1 else [(f"{prefix}.lr_warmup_steps", v)]  # verl: -1 = from the ratio
    return fn


def _schedule(prefix: str) -> Callable[[Any], list]:
    def fn(v: Any) -> list[tuple[str, Any]]:
        if v is None:  # verl's deprecated warmup_style, unset
            return []
        if v in ("constant", "cosine", "linear"):
            return [(f"{prefix}.lr_decay_style", v)]
        raise Unsupported(f"schedules here are constant, linear and cosine ({prefix}.lr_decay_style)")
    return fn


def _samples(key: str) -> Callable[[Any], list]:
    return lambda v: [(key, None if v is None or v < 0 else v)]


def _optim(at: str, ours: str) -> list[tuple]:
    """The optimizer keys of verl's megatron and FSDP optimizers under ``at`` -> our OptimConfig ``ours``."""
    return [
        (f"{at}.betas", "fn", _betas(ours)),
        (f"{at}.lr_warmup_steps", "fn", _warmup_steps(ours)),
        (f"{at}.lr_warmup_steps_ratio", "neutral", ((0, 0.0), f"give the warm-up in steps: {ours}.lr_warmup_steps")),
        (f"{at}.lr_scheduler_type", "fn", _schedule(ours)),
        (f"{at}.warmup_style", "fn", _schedule(ours)),
        (f"{at}.optimizer", "neutral", (("adam", "adamw", "AdamW"), "the optimizer is megatron's Adam (AdamW)")),
        (f"{at}.optimizer_impl", "neutral", (("torch.optim", None), "the optimizer is megatron's Adam (AdamW)")),
        (f"{at}.use_precision_aware_optimizer", "map", f"{ours}.use_precision_aware_optimizer"),
        (f"{at}.use_layer_wise_distributed_optimizer", "neutral", ((False,), "use actor.optim.use_distributed_"
                                                                            "optimizer")),
        *[(f"{at}.{n}", "fn", dtype_rule(f"{ours}.{n}")) for n in MEGATRON_DTYPES],
        (f"{at}.zero_indexed_step", "ignore", "the schedule counts steps as megatron's scheduler does"),
        (f"{at}.muon_*", "ignore", "only for optimizer=muon"),
        (f"{at}.lr_warmup_init", "neutral", ((0, 0.0), "warm-up starts at 0")),
        (f"{at}.min_lr_ratio", "neutral", ((None, 0, 0.0), f"give the floor as {ours}.min_lr")),
        (f"{at}.weight_decay_incr_style", "neutral", (("constant",), "weight decay is constant")),
        (f"{at}.use_checkpoint_opt_param_scheduler", "neutral", ((False,), "the schedule comes from the config")),
        *optimizer_rules(at, ours),
        (f"{at}.total_training_steps", "ignore", "filled in by verl; here trainer.total_training_steps"),
        (f"{at}.lr_wsd_decay_style", "ignore", "only for the wsd schedule"),
        (f"{at}.lr_wsd_decay_steps", "ignore", "only for the wsd schedule"),
        (f"{at}.num_cycles", "ignore", "cosine runs once from lr to min_lr"),
        (f"{at}.**", "prefix", ours),
    ]


def _ignore(at: str, names: str, why: str) -> list[tuple]:
    """``ignore`` rules for the space-separated ``names`` under ``at`` (a name may end in ``.**``)."""
    return [(f"{at}.{n}", "ignore", why) for n in names.split()]


_ENGINE = "an SGLang engine setting chosen here"
_THROUGHPUT = "a throughput knob of verl's workers; batches here are fixed-size"


def _gradient_checkpointing(v: Any) -> list[tuple[str, Any]]:
    """verl's activation checkpointing switch -> megatron's full recompute (every layer; shared by all roles)."""
    if v in (None, False):
        return []
    if v is True:
        return [("parallel.recompute", "full")]
    raise Unsupported("enable_gradient_checkpointing is true or false (true: parallel.recompute=full)")


def _lora_rank(v: Any) -> list[tuple[str, Any]]:
    return [] if not v else [("model.lora.rank", v)]  # verl's megatron lora.rank; 0 (its default) keeps lora_rank


def _lora_a_init(v: Any) -> list[tuple[str, Any]]:
    if v in ("xavier", "kaiming"):
        return [("model.lora.a_init", v)]
    raise Unsupported("the LoRA A init here is xavier or kaiming (B starts at zero)")


def _lora(at: str) -> list[tuple]:
    """The actor's LoRA keys: verl's FSDP-style (lora_rank, lora_alpha, target_modules) and its megatron
    ``lora.*`` section both set ``model.lora`` (the last one given wins)."""
    why = "only plain LoRA (type lora, no dropout, B initialised to zero, adapters in the model's dtype)"
    return [
        (f"{at}.lora_rank", "map", "model.lora.rank"),
        (f"{at}.lora_alpha", "map", "model.lora.alpha"),
        (f"{at}.target_modules", "map", "model.lora.target_modules"),
        (f"{at}.exclude_modules", "neutral", (_OFF, "exclude_modules is not supported; list target_modules instead")),
        (f"{at}.lora_adapter_path", "neutral", ((None,), "loading a LoRA adapter is not supported; "
                                                          "merge it into the HF weights and use model.path")),
        (f"{at}.lora.rank", "fn", _lora_rank),
        (f"{at}.lora.alpha", "map", "model.lora.alpha"),
        (f"{at}.lora.target_modules", "map", "model.lora.target_modules"),
        (f"{at}.lora.lora_A_init_method", "fn", _lora_a_init),
        (f"{at}.lora.type", "neutral", (("lora",), why)),
        (f"{at}.lora.dropout", "neutral", ((0, 0.0, None), why)),
        (f"{at}.lora.lora_B_init_method", "neutral", (("zero",), why)),
        (f"{at}.lora.dtype", "neutral", ((None,), why)),
        (f"{at}.lora.exclude_modules", "neutral", (_OFF, "exclude_modules is not supported; list target_modules")),
        (f"{at}.lora.adapter_path", "neutral", ((None,), "loading a LoRA adapter is not supported; "
                                                         "merge it into the HF weights and use model.path")),
        (f"{at}.lora.merge", "ignore", "the rollout always gets the merged weights (W + alpha/r B A)"),
        (f"{at}.lora.**", "ignore", "a verl LoRA detail without effect here (dropout position, vision towers)"),
    ]


def _no_lora(at: str) -> list[tuple]:
    why = "LoRA on the critic is not supported; it trains fully"
    return [(f"{at}.lora_rank", "neutral", ((0,), why)), (f"{at}.lora.rank", "neutral", ((0,), why)),
            (f"{at}.lora_adapter_path", "neutral", ((None,), why)),
            (f"{at}.lora.adapter_path", "neutral", ((None,), why)),
            (f"{at}.lora.**", "ignore", "LoRA is off (rank 0)")]


def _model_common(at: str, lora: bool = False) -> list[tuple]:
    return [
        (f"{at}.trust_remote_code", "neutral", ((False, None), "models load with transformers' built-in classes")),
        (f"{at}.external_lib", "neutral", ((None, ""), "models load with transformers' built-in classes")),
        (f"{at}.override_config.**", "neutral", (_OFF, "edit the model's config.json instead")),
        (f"{at}.override_config", "neutral", (_OFF, "edit the model's config.json instead")),
        *(_lora(at) if lora else _no_lora(at)),
        (f"{at}.enable_activation_offload", "neutral", ((False,), "activation offload is not supported")),
        (f"{at}.enable_gradient_checkpointing", "fn", _gradient_checkpointing),
        (f"{at}.tiled_mlp.enabled", "neutral", ((False,), "tiled MLP is not supported")),
        (f"{at}.mtp.enable", "neutral", ((False,), "multi-token prediction is not supported")),
        (f"{at}.hf_config_path", "neutral", ((None,), "the config.json next to the weights is used")),
        *_ignore(at, "use_shm use_remove_padding use_fused_kernels fused_kernel_options.** use_liger "
                 "tiled_mlp.** mtp.** fsdp_config.**" + ("" if lora else " target_modules exclude_modules lora_alpha"),
                 "a verl model-loading detail (padding removal, fused kernels, shared memory, ...)"),
    ]


RULES: list[tuple] = [
    ("**._target_", "ignore", "verl's dataclass name"),
    ("hydra.**", "ignore", "Hydra runtime settings"),
    # ----------------------------------------------------------------- actor_rollout_ref.model
    ("actor_rollout_ref.model.path", "map", "model.path"),
    ("actor_rollout_ref.model.tokenizer_path", "map", "model.tokenizer_path"),
    ("actor_rollout_ref.model.custom_chat_template", "neutral",
     ((None,), "set chat_template in the tokenizer's tokenizer_config.json (model.tokenizer_path)")),
    *_model_common("actor_rollout_ref.model", lora=True),
    # ----------------------------------------------------------------- actor_rollout_ref.actor
    *_optim("actor_rollout_ref.actor.optim", "actor.optim"),
    *megatron_rules("actor_rollout_ref.actor.megatron", same=False, offload={
        "param": "actor.offload.params", "grad": "actor.offload.grads", "optimizer": "actor.offload.optimizer"},
        init="actor"),
    ("actor_rollout_ref.actor.grad_clip", "map", "actor.optim.clip_grad"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "neutral", ((None,), "give it per device: "
                                                                          "actor.ppo_micro_batch_size_per_gpu")),
    ("actor_rollout_ref.actor.use_dynamic_bsz", "map", "actor.use_dynamic_bsz"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "map", "actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "neutral", ((1,), "use parallel.sequence_parallel")),
    ("actor_rollout_ref.actor.use_prefix_grouper", "neutral", ((False,), "not supported")),
    ("actor_rollout_ref.actor.router_replay.mode", "neutral", (("disabled",), "MoE router replay is not supported")),
    ("actor_rollout_ref.actor.load_weight", "neutral", ((True,), "the actor starts from model.path")),
    ("actor_rollout_ref.actor.calculate_sum_pi_squared", "neutral", ((False,), "not supported")),
    ("actor_rollout_ref.actor.qat.enable", "neutral", ((False,), "quantization-aware training is not supported")),
    ("actor_rollout_ref.actor.policy_loss.dro_beta", "ignore", "only for a DRO policy loss, not supported here"),
    ("actor_rollout_ref.actor.data_loader_seed", "ignore", _SHUFFLE_SEED),
    *_ignore("actor_rollout_ref.actor", "strategy rollout_n use_torch_compile "
             "calculate_entropy freeze_vision_tower use_fused_kernels use_remove_padding "
             "entropy_from_logits_with_chunking entropy_checkpointing checkpoint.** profiler.** router_replay.** "
             "fsdp_config.** sum_pi_squared_checkpointing qat.** entropy_from_logits_chunk_size pad_to_length",
             "a verl actor-worker detail (compilation, checkpoint contents, profiler, ...)"),
    ("actor_rollout_ref.actor.**", "prefix", "actor"),
    # ----------------------------------------------------------------- actor_rollout_ref.ref
    *megatron_rules("actor_rollout_ref.ref.megatron", same=True, offload={
        "param": "actor.ref_param_offload", "grad": None, "optimizer": None}, init="actor"),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "ignore", "the reference's log-prob forward batches by tokens "
                                                                 "exactly when actor.use_dynamic_bsz"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", "neutral",
     ((None,), "give it per device: actor.log_prob_micro_batch_size_per_gpu")),
    ("actor_rollout_ref.ref.**", "ignore", "the reference is the frozen initial actor, in the actor's layout and "
                                           "micro batches (actor.log_prob_micro_batch_size_per_gpu)"),
    # ----------------------------------------------------------------- actor_rollout_ref.rollout
    ("actor_rollout_ref.rollout.name", "fn", _rollout_name),
    ("actor_rollout_ref.rollout.mode", "ignore", "verl's sync/async; rollout.mode here is colocated|disaggregated"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", "map", "rollout.mem_fraction_static"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "map", "actor.log_prob_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size", "neutral",
     ((None,), "give it per device: actor.log_prob_micro_batch_size_per_gpu")),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "ignore", "the log-prob forwards batch by tokens exactly "
                                                                    "when actor.use_dynamic_bsz"),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "map", "actor.log_prob_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", "map",
     "rollout.weight_sync_bucket_mb"),
    ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", "map", "rollout.weight_sync_bucket_mb"),
    ("actor_rollout_ref.rollout.do_sample", "neutral", ((True,), "for greedy decoding set rollout.temperature=0")),
    ("actor_rollout_ref.rollout.val_kwargs.do_sample", "ignore", "validation is greedy when "
                                                                 "rollout.val_kwargs.temperature=0"),
    ("actor_rollout_ref.rollout.ignore_eos", "neutral", ((False,), "responses stop at EOS")),
    ("actor_rollout_ref.rollout.data_parallel_size", "neutral", ((1, None), "use rollout.num_engines")),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "neutral", ((1, None), "engines use tensor "
                                                                                     "parallelism only")),
    ("actor_rollout_ref.rollout.expert_parallel_size", "neutral", ((1, None), "expert parallelism inside the rollout "
                                                                             "engine is not supported (MoE models "
                                                                             "are served under the engine's tensor "
                                                                             "parallelism)")),
    ("actor_rollout_ref.rollout.over_sample_rate", "neutral", ((0, 0.0), "not supported")),
    ("actor_rollout_ref.rollout.multi_turn.enable", "neutral", ((False,), "multi-turn / tool rollouts are not "
                                                                         "supported")),
    ("actor_rollout_ref.rollout.skip_rollout", "neutral", ((False,), "not supported")),
    ("actor_rollout_ref.rollout.enable_rollout_routing_replay", "neutral", ((False,), "MoE router replay (the "
                                                                                     "engine's expert routing "
                                                                                     "reused in training) is not "
                                                                                     "supported")),
    ("actor_rollout_ref.rollout.quantization", "neutral", ((None,), "rollouts run in rollout.dtype")),
    ("actor_rollout_ref.rollout.quantization_config_file", "neutral", ((None,), "rollouts run in rollout.dtype")),
    ("actor_rollout_ref.rollout.prometheus.enable", "neutral", ((False,), "Prometheus metrics of the rollout "
                                                                         "servers are not supported (the run's "
                                                                         "metrics go to trainer.logger)")),
    ("actor_rollout_ref.rollout.full_determinism", "neutral", ((False,), "not supported")),
    ("actor_rollout_ref.rollout.disaggregation.enabled", "neutral", ((False,), "prefill/decode disaggregation is not "
                                                                              "supported")),
    ("actor_rollout_ref.rollout.qat.enable", "neutral", ((False,), "quantization-aware training is not supported")),
    ("actor_rollout_ref.rollout.seed", "ignore", "per-request sampling seeds come from trainer.seed"),
    ("actor_rollout_ref.rollout.nnodes", "ignore", "engines run on the trainer's nodes (rollout.num_engines)"),
    ("actor_rollout_ref.rollout.n_gpus_per_node", "ignore", "engines run on the trainer's GPUs (rollout.num_engines)"),
    ("actor_rollout_ref.rollout.temperature", "map", "rollout.temperature"),
    ("actor_rollout_ref.rollout.top_p", "map", "rollout.top_p"),
    ("actor_rollout_ref.rollout.top_k", "map", "rollout.top_k"),
    ("actor_rollout_ref.rollout.n", "map", "rollout.n"),
    ("actor_rollout_ref.rollout.dtype", "map", "rollout.dtype"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", "map", "rollout.tensor_model_parallel_size"),
    ("actor_rollout_ref.rollout.val_kwargs.**", "prefix", "rollout.val_kwargs"),
    *_ignore("actor_rollout_ref.rollout", "prompt_length response_length", "taken from data.max_prompt_length / "
                                                                       "data.max_response_length"),
    *_ignore("actor_rollout_ref.rollout", "enforce_eager cudagraph_capture_sizes free_cache_engine "
             "max_num_batched_tokens max_model_len max_num_seqs enable_chunked_prefill enable_prefix_caching "
             "logprobs_mode scheduling_policy "
             "load_format disable_log_stats multi_stage_wake_up skip_tokenizer_init layered_summon calculate_log_probs "
             "skip_dump_dir limit_images engine_kwargs.** checkpoint_engine.** multi_turn.** agent.** trace.** "
             "profiler.** prometheus.** layer_name_map.** mtp.** mtp moe_load_balance_metrics_interval qat qat.** "
             "disaggregation.**", _ENGINE),
    ("actor_rollout_ref.rollout.**", "prefix", "rollout"),
    ("actor_rollout_ref.hybrid_engine", "ignore", "rollout.mode chooses colocated or disaggregated engines"),
    ("actor_rollout_ref.nccl_timeout", "ignore", "set by the process-group set-up"),
    # ----------------------------------------------------------------- critic
    ("critic.model.path", "map", "model.critic_path"),
    ("critic.model.tokenizer_path", "ignore", "the critic reads the actor's tokens"),
    ("critic.model.custom_chat_template", "ignore", "the critic reads the actor's tokens"),
    ("critic.loss_scale_factor", "neutral", ((None,), "the critic's loss is aggregated by critic.loss_agg_mode")),
    *_model_common("critic.model"),
    *_optim("critic.optim", "critic.optim"),
    *megatron_rules("critic.megatron", same=True, offload={
        "param": "critic.offload.params", "grad": "critic.offload.grads", "optimizer": "critic.offload.optimizer"},
        init="critic"),
    ("critic.grad_clip", "map", "critic.optim.clip_grad"),
    ("critic.ppo_micro_batch_size", "neutral", ((None,), "give it per device: critic.ppo_micro_batch_size_per_gpu")),
    ("critic.use_dynamic_bsz", "map", "critic.use_dynamic_bsz"),
    ("critic.ppo_max_token_len_per_gpu", "map", "critic.ppo_max_token_len_per_gpu"),
    ("critic.forward_max_token_len_per_gpu", "map", "critic.forward_max_token_len_per_gpu"),
    ("critic.ulysses_sequence_parallel_size", "neutral", ((1,), "use parallel.sequence_parallel")),
    ("critic.shuffle", "map", "critic.shuffle"),
    ("critic.data_loader_seed", "ignore", _SHUFFLE_SEED),
    *_ignore("critic", "rollout_n strategy "
             "forward_micro_batch_size forward_micro_batch_size_per_gpu nccl_timeout "
             "load_weight checkpoint.** "
             "profiler.** fsdp.** fsdp_config.**",
             "a verl critic-worker detail (token budgets, checkpoints, profiler)"),
    # ----------------------------------------------------------------- data
    ("data.train_max_samples", "fn", _samples("data.max_train_samples")),
    ("data.val_max_samples", "fn", _samples("data.max_val_samples")),
    ("data.apply_chat_template_kwargs", "map", "data.chat_template_kwargs"),
    ("data.tokenizer", "neutral", ((None,), "use model.tokenizer_path")),
    ("data.reward_fn_key", "neutral", (("data_source",), "rows are scored by their data_source")),
    ("data.val_batch_size", "neutral", ((None,), "set data.val_batch_size to a number")),
    ("data.seed", "neutral", ((None,), "set data.seed to a number")),
    ("data.validation_shuffle", "neutral", ((False,), "validation runs in file order")),
    ("data.trust_remote_code", "neutral", ((False,), "not needed: files and hub datasets load without code")),
    ("data.tool_config_path", "neutral", ((None,), "tool use is not supported")),
    ("data.custom_cls.path", "neutral", ((None,), "rows are read by the built-in dataset (prompt, data_source, "
                                                  "reward_model.ground_truth)")),
    ("data.sampler.class_path", "neutral", ((None,), "prompts are shuffled by data.shuffle / data.seed")),
    ("data.datagen.path", "neutral", ((None,), "not supported")),
    ("data.function_tool_path", "neutral", ((None,), "tool use is not supported")),
    ("data.mm_processor_kwargs", "neutral", (_OFF, "multi-modal inputs are not supported")),
    ("data.return_raw_chat", "ignore", "the raw prompt messages are always kept"),
    ("data.gen_batch_size", "ignore", "dynamic sampling generates data.train_batch_size prompts per round "
                                      "(algorithm.filter_groups)"),
    *_ignore("data", "use_shm return_raw_input_ids return_full_prompt dataloader_num_workers image_patch_size "
             "filter_overlong_prompts_workers image_key video_key return_multi_modal_inputs custom_cls.name "
             "sampler.class_name datagen.name audio_key",
             "a verl data-loader detail (workers, shared memory, images, ...)"),
    # ----------------------------------------------------------------- trainer
    ("trainer.max_actor_ckpt_to_keep", "map", "trainer.max_ckpt_to_keep"),
    ("trainer.profile_steps", "map", "global_profiler.steps"),
    ("trainer.max_critic_ckpt_to_keep", "ignore", "one count for both: trainer.max_ckpt_to_keep"),
    ("trainer.default_hdfs_dir", "neutral", ((None,), "copy trainer.default_local_dir yourself")),
    ("trainer.val_only", "neutral", ((False,), "not supported; evaluate with trainer.val_before_train and "
                                              "trainer.total_training_steps")),
    ("trainer.rollout_data_dir", "neutral", ((None,), "use trainer.log_val_generations")),
    ("trainer.validation_data_dir", "neutral", ((None,), "use trainer.log_val_generations")),
    ("trainer.device", "neutral", (("cuda", "cpu"), "cuda is used when available, else the CPU")),
    *_ignore("trainer", "balance_batch esi_redundant_time del_local_ckpt_after_load ray_wait_register_center_timeout "
             "use_legacy_worker_impl profile_continuous_steps controller_nsight_options.** "
             "worker_nsight_options.** npu_profile.**",
             "a verl trainer detail (batch balancing, Ray timeouts, profiling)"),
    # ----------------------------------------------------------------- algorithm
    # our layout, verl's names
    ("rollout.gpu_memory_utilization", "map", "rollout.mem_fraction_static"),
    ("rollout.log_prob_micro_batch_size_per_gpu", "map", "actor.log_prob_micro_batch_size_per_gpu"),
    ("algorithm.use_pf_ppo", "neutral", ((False,), "preference-feedback PPO is not supported")),
    ("algorithm.rollout_correction.rollout_is", "neutral", ((None,), "rollout importance sampling is not supported")),
    ("algorithm.rollout_correction.rollout_rs", "neutral", ((None,), "rollout rejection sampling is not supported")),
    ("algorithm.rollout_correction.**", "ignore", "rollout correction is off"),
    ("algorithm.pf_ppo.**", "ignore", "preference-feedback PPO is off"),
    ("algorithm.filter_groups.max_inflight_gen_batches", "ignore", "generation rounds run one at a time "
                                                                   "(algorithm.filter_groups.max_num_gen_batches)"),
    # ----------------------------------------------------------------- rewards
    ("custom_reward_function.**", "prefix", "reward.custom_reward_function"),
    ("reward_model.overlong_buffer.log", "ignore", "the penalty is always logged (dapo/overlong_penalty/mean)"),
    ("reward_model.overlong_buffer.**", "prefix", "reward.overlong_buffer"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.log", "ignore", "the penalty is always logged"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.**", "prefix", "reward.overlong_buffer"),
    ("reward_model.reward_manager", "neutral", (("naive", "dapo", "prime", "batch", None), "rewards come from "
                                                                                          "reward.sources")),
    ("reward_model.micro_batch_size", "neutral", ((None,), "give it per device: "
                                                          "reward_model.micro_batch_size_per_gpu")),
    ("reward_model.sandbox_fusion.url", "neutral", ((None,), "code sandboxes are not supported; use a custom "
                                                            "reward (custom_reward_function.path)")),
    ("reward_model.model.trust_remote_code", "neutral", ((False, None), "models load with transformers' built-in "
                                                                  "classes")),
    ("reward_model.model.external_lib", "neutral", ((None, ""), "models load with transformers' built-in classes")),
    ("reward_model.model.override_config", "neutral", (_OFF, "edit the model's config.json instead")),
    ("reward_model.enable", "reward_model", "enable"),
    ("reward_model.model.path", "reward_model", "path"),
    ("reward_model.micro_batch_size_per_gpu", "reward_model", "micro_batch_size"),
    ("reward_model.max_length", "reward_model", "max_length"),
    *_ignore("reward_model", "strategy enable_resource_pool n_gpus_per_node nnodes use_dynamic_bsz "
             "forward_max_token_len_per_gpu launch_reward_fn_async reward_loop_source reward_loop_module_path "
             "reward_loop_class_name nccl_timeout load_weight use_reward_loop num_workers model.input_tokenizer "
             "model.use_remove_padding model.use_fused_kernels model.fsdp_config.** sandbox_fusion.** profiler.** "
             "megatron.** rollout.** reward_kwargs.** model.use_shm ulysses_sequence_parallel_size",
             "a verl reward-worker detail"),
    # verl's newer layout: reward.{reward_model,reward_manager,sandbox_fusion}.* (reward.custom_reward_function is ours)
    ("reward.reward_model.enable", "reward_model", "enable"),
    ("reward.reward_model.model_path", "reward_model", "path"),
    ("reward.reward_manager.name", "neutral", (("naive", "dapo", "prime", "batch"), "rewards come from "
                                                                                   "reward.sources")),
    ("reward.reward_manager.source", "neutral", (("register",), "rewards come from reward.sources")),
    ("reward.reward_manager.module.path", "neutral", ((None,), "give the scoring function as "
                                                               "reward.custom_reward_function.path")),
    ("reward.sandbox_fusion.url", "neutral", ((None,), "code sandboxes are not supported; use a custom reward "
                                                      "(reward.custom_reward_function.path)")),
    ("sandbox_fusion.url", "neutral", ((None,), "code sandboxes are not supported")),
    *_ignore("reward", "num_workers reward_manager.** sandbox_fusion.** reward_model.**", "a verl reward-worker "
             "detail (an engine-served reward model's settings, worker counts)"),
    ("sandbox_fusion.**", "ignore", "code sandboxes are not supported"),
    ("reward_manager.**", "ignore", "rewards come from reward.sources"),
    # ----------------------------------------------------------------- whole sections verl has and we do not
    ("transfer_queue.enable", "neutral", ((False,), "not supported")),
    ("model_engine", "ignore", "training runs on megatron-core here whatever the engine named"),
    ("distillation.enabled", "neutral", ((False,), "on-policy distillation is not supported")),
    ("distillation.**", "ignore", "distillation is off"),
    ("skip.*.enable", "neutral", ((False,), "rollouts are always generated (no replay from a dump)")),
    ("skip.**", "ignore", "rollout skipping is off"),
    ("trainer.use_v1", "ignore", "verl's trainer implementation switch"),
    ("trainer.v1.**", "ignore", "settings of verl's v1 trainer (asynchronous modes)"),
    ("global_profiler.finish_hook_cmd", "neutral", ((None, ""), "no command is run after profiling here")),
    ("global_profiler.global_tool_config.**", "ignore", "nsys / npu options: nsys is configured on its command line"),
    ("global_profiler.**", "ignore", "verl's profiler detail (result relocation, finish hooks); traces are written "
                                     "to global_profiler.save_path"),
    ("transfer_queue.**", "ignore", "not supported"),
    ("ray_kwargs.**", "ignore", "Ray is started by the trainer"),
    ("ray_init.**", "ignore", "Ray is started by the trainer"),
]

#: rules that also apply to keys of our own schema (a value rewritten, the key kept)
OURS: list[tuple] = [
    ("trainer.logger", "fn", _logger),
    ("actor.optim.lr_warmup_steps", "fn", _warmup_steps("actor.optim")),
    ("critic.optim.lr_warmup_steps", "fn", _warmup_steps("critic.optim")),
]
