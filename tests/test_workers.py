"""rlhf/workers: the batch layout (hand-computed tensors), micro/mini batch arithmetic, and THE mini-batch
update loop's schedule for the PPO actor, the critic and DPO (megatron's forward/backward and the
optimizer replaced by recorders).  CPU only, fast."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.rollout.types import RolloutSample
from rlhf.workers import worker as worker_mod
from rlhf.workers.batch import (
    build_pair_batch,
    build_rollout_batch,
    dp_slice,
    micro_batch_size,
    mini_batches,
    outcome_token_scores,
)
from rlhf.workers.losses import DPOLoss, PPOPolicyLoss
from rlhf.workers.worker import MegatronWorker


def test_build_rollout_batch_layout():
    samples = [RolloutSample([7, 8], [5, 2], [-0.5, -0.25], "stop", 0, 0),
               RolloutSample([9], [6, 6, 2], [-1.0, -2.0, -3.0], "stop", 1, 0),
               RolloutSample([4, 4, 4], [], [], "abort", 2, 0)]
    b = build_rollout_batch(samples, pad_token_id=0, max_response_length=4)
    assert b["prompt_length"] == 3
    assert b["input_ids"].tolist() == [[0, 7, 8, 5, 2, 0, 0], [0, 0, 9, 6, 6, 2, 0], [4, 4, 4, 0, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 2, 2, 2, 2]]
    assert b["responses"].tolist() == [[5, 2, 0, 0], [6, 6, 2, 0], [0, 0, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    assert b["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0, 0], [-1, -2, -3, 0], [0, 0, 0, 0]]
    assert b["rollout_log_probs"].dtype == torch.float32 and b["input_ids"].dtype == torch.long
    with pytest.raises(ValueError, match="max_response_length=2"):
        build_rollout_batch(samples, 0, 2)
    with pytest.raises(ValueError, match="no rollout samples"):
        build_rollout_batch([], 0, 2)
    scores = outcome_token_scores([1.0, 0.5, 2.0], b["response_mask"])
    assert scores.tolist() == [[0, 1, 0, 0], [0, 0, 0.5, 0], [2, 0, 0, 0]]


def test_build_pair_batch_rows_and_n():
    pairs = [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]},
             {"prompt_ids": [6], "chosen_ids": [7, 8], "rejected_ids": [9]}]
    b = build_pair_batch(pairs, pad_token_id=0, max_response_length=2)
    assert b["n"] == 2 and "rollout_log_probs" not in b
    assert b["input_ids"].tolist() == [[1, 2, 3, 0], [1, 2, 4, 5], [0, 6, 7, 8], [0, 6, 9, 0]]


@pytest.mark.parametrize("n_local,requested,group,expected", [
    (8, 16, 1, 8), (8, 3, 1, 2), (6, 4, 1, 3), (7, 4, 1, 1), (4, 0, 1, 1),
    (8, 4, 2, 4), (12, 8, 2, 6), (10, 8, 2, 2), (6, 1, 2, 2), (4, 16, 2, 4),
])
def test_micro_batch_size(n_local, requested, group, expected):
    assert micro_batch_size(n_local, requested, group) == expected


def test_mini_batches_order_seed_and_dp_slice():
    batch = {"input_ids": torch.arange(8).view(8, 1), "x": torch.arange(8) * 10}
    got = [mb["x"].tolist() for mb in mini_batches(batch, ["x"], 2, None, dp_rank=1, dp_size=2)]
    assert got == [[20, 30], [60, 70]]  # rows 0-3 and 4-7, this rank's second half of each
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(5)).tolist()
    got = [mb["x"].tolist() for mb in mini_batches(batch, ["x"], 4, 5, dp_rank=0, dp_size=1)]
    assert got == [[perm[i] * 10, perm[i + 1] * 10] for i in range(0, 8, 2)]
    with pytest.raises(ValueError, match="data-parallel size 3"):
        dp_slice(torch.zeros(8), 0, 3)


@pytest.fixture
def recorder(monkeypatch):
    """MegatronWorker.train_mini_batches with megatron stubbed: records each optimizer step's rows and
    micro batch size, and the forward kwargs; grad norm = step count."""
    log = {"steps": [], "zero": 0}
    monkeypatch.setattr(worker_mod, "dp_info", lambda: (0, 1, None))

    def forward_backward(model, mb, *, forward_only, loss_fn, micro_batch_size, **kw):
        assert not forward_only and set(mb) >= {"input_ids", "attention_mask", "position_ids"}
        log["steps"].append((mb["input_ids"][:, 0].tolist(), micro_batch_size, sorted(mb), kw))
        return [{"m": float(len(log["steps"]))}]

    monkeypatch.setattr(worker_mod, "forward_backward", forward_backward)
    monkeypatch.setattr(worker_mod, "zero_grads", lambda state: log.__setitem__("zero", log["zero"] + 1))
    monkeypatch.setattr(worker_mod, "optimizer_step", lambda state: (True, float(len(log["steps"]))))
    return log


def _batch(n_rows, n):
    return {"input_ids": torch.arange(n_rows).view(-1, 1).repeat(1, 3), "attention_mask": torch.ones(n_rows, 3),
            "position_ids": torch.zeros(n_rows, 3), "response_mask": torch.ones(n_rows, 2),
            "old_log_probs": torch.zeros(n_rows, 2), "advantages": torch.zeros(n_rows, 2),
            "ref_logps": torch.zeros(n_rows), "n": n}


def test_update_loop_ppo_epochs_shuffle_and_micro(recorder):
    w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
    loss = PPOPolicyLoss(SimpleNamespace(use_kl_loss=False))
    # 4 prompts x n=2 = 8 rows; mini batch of 2 prompts = 4 rows -> 2 optimizer steps per epoch
    _, norms = w.train_mini_batches(_batch(8, 2), ("input_ids", "attention_mask", "position_ids") + loss.keys, loss,
                                    mini_batch_size=2, micro_batch_size_per_gpu=3, epochs=2, step=3,
                                    kind="log_probs", calculate_entropy=True)
    assert norms == [1.0, 2.0, 3.0, 4.0] and recorder["zero"] == 4
    rows = [r for r, _, _, _ in recorder["steps"]]
    for epoch in range(2):  # each epoch a permutation seeded by step * 1000 + epoch
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(3000 + epoch)).tolist()
        assert rows[2 * epoch:2 * epoch + 2] == [perm[:4], perm[4:]]
    assert {m for _, m, _, _ in recorder["steps"]} == {2}  # largest divisor of 4 rows <= 3
    assert recorder["steps"][0][2] == sorted(("input_ids", "attention_mask", "position_ids", "old_log_probs",
                                              "advantages", "response_mask"))
    assert recorder["steps"][0][3] == {"kind": "log_probs", "calculate_entropy": True}


def test_update_loop_dpo_pairs_in_order(recorder):
    w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
    loss = DPOLoss(SimpleNamespace())
    # 6 pairs (12 rows, n=2), mini batch of 2 pairs -> 3 steps over rows in order; micro 3 -> 2 (whole pairs)
    w.train_mini_batches(_batch(12, 2), ("input_ids", "attention_mask", "position_ids") + loss.keys, loss,
                         mini_batch_size=2, micro_batch_size_per_gpu=3, epochs=1, step=9, micro_group=loss.micro_group)
    assert [r for r, _, _, _ in recorder["steps"]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [m for _, m, _, _ in recorder["steps"]] == [2, 2, 2]
