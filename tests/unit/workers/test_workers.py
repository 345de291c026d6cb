"""rlhf/workers: the batch layout (hand-computed tensors), micro/mini batch arithmetic, and THE mini-batch
update loop's schedule for the PPO actor, the critic and DPO (megatron's forward/backward and the
optimizer replaced by recorders).  CPU only, fast."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel.optim import StepResult
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
from rlhf.workers.worker import MegatronWorker, step_metrics


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
    monkeypatch.setattr(worker_mod, "optimizer_step",
                        lambda state: StepResult(skipped=False, grad_norm=float(len(log["steps"])), lr=0.0))
    return log


def _batch(n_rows, n):
    return {"input_ids": torch.arange(n_rows).view(-1, 1).repeat(1, 3), "attention_mask": torch.ones(n_rows, 3),
            "position_ids": torch.zeros(n_rows, 3), "response_mask": torch.ones(n_rows, 2),
            "loss_mask": torch.ones(n_rows, 2),
            "old_log_probs": torch.zeros(n_rows, 2), "advantages": torch.zeros(n_rows, 2),
            "ref_logps": torch.zeros(n_rows), "n": n}


def test_update_loop_ppo_epochs_shuffle_and_micro(recorder):
    w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
    loss = PPOPolicyLoss(SimpleNamespace(use_kl_loss=False))
    # 4 prompts x n=2 = 8 rows; mini batch of 2 prompts = 4 rows -> 2 optimizer steps per epoch
    _, steps = w.train_mini_batches(_batch(8, 2), ("input_ids", "attention_mask", "position_ids") + loss.keys, loss,
                                    mini_batch_size=2, micro_batch_size_per_gpu=3, epochs=2, step=3,
                                    kind="log_probs", calculate_entropy=True)
    assert [r.grad_norm for r in steps] == [1.0, 2.0, 3.0, 4.0] and recorder["zero"] == 4
    rows = [r for r, _, _, _ in recorder["steps"]]
    for epoch in range(2):  # each epoch a permutation seeded by step * 1000 + epoch
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(3000 + epoch)).tolist()
        assert rows[2 * epoch:2 * epoch + 2] == [perm[:4], perm[4:]]
    assert {m for _, m, _, _ in recorder["steps"]} == {2}  # largest divisor of 4 rows <= 3
    assert recorder["steps"][0][2] == sorted(("input_ids", "attention_mask", "position_ids", "old_log_probs",
                                              "advantages", "response_mask", "loss_mask", "global_info"))
    assert recorder["steps"][0][3] == {"kind": "log_probs", "calculate_entropy": True}


def test_update_loop_dpo_pairs_in_order(recorder):
    w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
    loss = DPOLoss(SimpleNamespace())
    # 6 pairs (12 rows, n=2), mini batch of 2 pairs -> 3 steps over rows in order; micro 3 -> 2 (whole pairs)
    w.train_mini_batches(_batch(12, 2), ("input_ids", "attention_mask", "position_ids") + loss.keys, loss,
                         mini_batch_size=2, micro_batch_size_per_gpu=3, epochs=1, step=9, micro_group=loss.micro_group)
    assert [r for r, _, _, _ in recorder["steps"]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [m for _, m, _, _ in recorder["steps"]] == [2, 2, 2]


@pytest.mark.parametrize("shuffle", [False, True])
def test_update_loop_one_epoch_in_order_or_shuffled(recorder, shuffle):
    """actor.shuffle (verl's): one epoch visits the rows in a permutation seeded by step * 1000 (+ epoch), so a
    mini batch mixes prompt groups; without it, in order (whole groups per mini batch)."""
    w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
    loss = PPOPolicyLoss(SimpleNamespace(use_kl_loss=False))
    w.train_mini_batches(_batch(8, 2), ("input_ids", "attention_mask", "position_ids") + loss.keys, loss,
                         mini_batch_size=2, micro_batch_size_per_gpu=4, epochs=1, step=5, shuffle=shuffle)
    rows = [r for r, _, _, _ in recorder["steps"]]
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(5000)).tolist() if shuffle else list(range(8))
    assert rows == [perm[:4], perm[4:]]
    assert shuffle == (rows != [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_update_loop_shuffled_dpo_pairs_stay_whole(recorder):
    """A shuffled pass permutes whole pairs (micro_group 2): every mini batch holds both rows of each of its pairs,
    and every row is visited once."""
    w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
    loss = DPOLoss(SimpleNamespace())
    w.train_mini_batches(_batch(12, 2), ("input_ids", "attention_mask", "position_ids") + loss.keys, loss,
                         mini_batch_size=2, micro_batch_size_per_gpu=2, epochs=1, step=4, micro_group=loss.micro_group,
                         shuffle=True)
    rows = [r for r, _, _, _ in recorder["steps"]]
    pairs = torch.randperm(6, generator=torch.Generator().manual_seed(4000)).tolist()
    assert rows == [[2 * p + j for p in pairs[i:i + 2] for j in (0, 1)] for i in (0, 2, 4)]
    assert sorted(r for step in rows for r in step) == list(range(12)) and rows[0] != [0, 1, 2, 3]
    with pytest.raises(ValueError, match="whole groups of 2"):
        w.train_mini_batches(_batch(7, 1), ("input_ids", "attention_mask", "position_ids") + loss.keys, loss,
                             mini_batch_size=7, micro_batch_size_per_gpu=2, epochs=1, step=4, micro_group=2,
                             shuffle=True)


def test_step_metrics_count_skips_and_breaker_events():
    steps = [StepResult(False, 2.0, 0.1), StepResult(True, float("inf"), 0.1),
             StepResult(False, 4.0, 0.1, breaker="ev")]
    m = step_metrics("critic", steps[::2])
    assert m == {"critic/grad_norm": 3.0, "critic/num_skipped_steps": 0.0, "critic/num_breaker_events": 1.0,
                 "critic/lr": 0.1}  # the LR of the last optimizer step
    assert step_metrics("actor", steps)["actor/num_skipped_steps"] == 1.0


def _ppo_cfg(**kw):
    return SimpleNamespace(**{**dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                                     loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True,
                                     kl_loss_type="low_var_kl", kl_loss_coef=0.1), **kw})


def test_losses_read_the_response_columns_even_when_the_forward_padded_the_sequence():
    """parallel.forward pads S at the right under sequence parallelism: the response is columns [P, P + R),
    not the last R; the loss on padded outputs equals the loss on unpadded ones."""
    g = torch.Generator().manual_seed(0)
    P, R, b = 3, 4, 2
    lp, ent = -torch.rand(b, P + R, generator=g), torch.rand(b, P + R, generator=g)
    mb = {"response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), "loss_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
          "old_log_probs": -torch.rand(b, R, generator=g),
          "advantages": torch.randn(b, R, generator=g), "ref_log_probs": -torch.rand(b, R, generator=g),
          "ref_logps": torch.tensor([-1.0, -2.0])}
    junk = torch.full((b, 5), 7.0)
    padded = {"log_probs": torch.cat([lp, junk], 1), "entropy": torch.cat([ent, junk], 1)}
    loss = PPOPolicyLoss(_ppo_cfg())
    a, ma = loss({"log_probs": lp, "entropy": ent}, mb, P)
    c, mc = loss(padded, mb, P)
    assert torch.equal(a, c) and all(float(ma[k]) == float(mc[k]) for k in ma) and set(ma) == set(mc)
    # the value by hand: ratio on the response tokens, token-mean clipped loss, entropy bonus, KL loss
    mask = mb["response_mask"].bool()
    ratio = (lp[:, P:] - mb["old_log_probs"]).exp()
    adv = mb["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)[mask].mean()
    d = mb["ref_log_probs"] - lp[:, P:]
    kl = (d.exp() - d - 1).clamp(-10, 10)[mask].mean()
    assert torch.allclose(a, pg - 0.01 * ent[:, P:][mask].mean() + 0.1 * kl, atol=1e-6)
    dpo = DPOLoss(SimpleNamespace(beta=0.1, label_smoothing=0.0, loss_type="sigmoid"))
    x, _ = dpo({"log_probs": lp}, mb, P)
    y, _ = dpo({"log_probs": padded["log_probs"]}, mb, P)
    seq = (lp[:, P:] * mb["response_mask"]).sum(1)
    h = (seq[0] - mb["ref_logps"][0]) - (seq[1] - mb["ref_logps"][1])
    assert torch.equal(x, y) and torch.allclose(x, -torch.nn.functional.logsigmoid(0.1 * h), atol=1e-6)
    # IPO compares the per-token-averaged margin (lengths from the response mask: 3 and 2 tokens)
    ipo = DPOLoss(SimpleNamespace(beta=0.1, label_smoothing=0.0, loss_type="ipo"))
    z, _ = ipo(padded, mb, P)
    h_avg = (seq[0] - mb["ref_logps"][0]) / 3 - (seq[1] - mb["ref_logps"][1]) / 2
    assert torch.allclose(z, (h_avg - 1 / (2 * 0.1)) ** 2, atol=1e-5)
