"""Workers: the megatron models the trainers compose, and the rollout glue.

    rlhf.workers.actor:   MegatronActor (compute_log_prob, update_policy) -- actor and frozen reference
    rlhf.workers.critic:  MegatronCritic (compute_values, update_critic)
    rlhf.workers.losses:  PPOPolicyLoss, DPOLoss (plugged into update_policy)
    rlhf.workers.worker:  MegatronWorker (no-grad forward, THE mini-batch update loop), gather_metrics
    rlhf.workers.batch:   padded batch layout, data-parallel slicing / gathering, mini and micro batches
    rlhf.workers.build:   model path, tokenizer, HF config, actor / reference / critic from the config
    rlhf.workers.rollout: RolloutWorker (SGLang engines on rank 0, weight sync, generate-and-score)
"""
