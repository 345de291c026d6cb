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
