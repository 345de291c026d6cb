"""megatron-core layer of the trainer: distributed state, models built from HF configs, forward/backward,
log-probs, optimizers, checkpoints, HF conversion and weight sync.  Knows nothing of RL."""
