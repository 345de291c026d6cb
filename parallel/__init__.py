"""The megatron-core layer of the trainer: process groups and devices, models built from HF configs,
forward/backward, log-probs, optimizers, LR schedules, the step guard, dist checkpoints, kernels, MoE, RoPE, the
one CPU-patch module, HF conversion (`parallel.convert`) and the data-parallel helpers.  Knows nothing of RL:
it imports nothing from `rlhf` (tests/unit/test_layout_rules.py)."""
