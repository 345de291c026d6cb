"""Test doubles shared by the fast tests (no engine, no megatron)."""
from __future__ import annotations


class FakePromptLoader:
    """StatefulPromptLoader stand-in: `next_batch()` hands out the given batches in order."""

    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)


class FakeRollout:
    """RolloutWorker stand-in (rlhf/workers/rollout.py): `generate` returns the canned
    (samples, scores, reward_metrics) results in order and records (batch, sampling, reward, seed)."""

    train_sampling, val_sampling = "train", "val"

    def __init__(self, results):
        self.results = list(results)
        self.calls = []
        self.synced = 0

    def generate(self, batch, sampling, reward, seed=None):
        self.calls.append((batch, sampling, reward, seed))
        return self.results.pop(0)

    def sync_weights(self):
        self.synced += 1

    def serving(self):
        import contextlib

        return contextlib.nullcontext()


class FakeActor:
    """MegatronActor / MegatronCritic stand-in: log-probs / values of zeros, updates recorded by step."""

    def __init__(self):
        self.updates = []

    def compute_log_prob(self, batch):
        import torch

        return {"log_probs": torch.zeros(batch["response_mask"].shape)}

    def compute_values(self, batch):
        import torch

        return torch.zeros(batch["response_mask"].shape)

    def update_policy(self, batch, loss, step):
        self.updates.append(step)
        return {"actor/pg_loss": 0.5}

    def update_critic(self, batch, step):
        self.updates.append(step)
        return {"critic/vf_loss": 0.25}
