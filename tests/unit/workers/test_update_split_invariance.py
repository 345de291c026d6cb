"""Through the trainer's update loop: the actor's policy loss (every registered loss mode x
every aggregation mode, entropy bonus and KL loss included), the critic's value loss and DPO give the same
gradient for every optimizer step, and the same loss metrics, however a mini batch is cut into micro batches
(1, 2, 4 rows) and data-parallel ranks (1, 2).

MegatronWorker.train_mini_batches runs for real; megatron is replaced by what it does to the loss: the
pipeline schedule divides each micro batch's loss by the number of micro batches before backward, and DDP
averages the gradients over data-parallel ranks (here: the ranks run one after the other and their
gradients are averaged).  The model is a table of per-token outputs (a leaf tensor), so the gradient of a
whole-mini-batch loss is known exactly.  Clip-Cov / KL-Cov select tokens per micro batch by design
(docs/algorithms.md) and are left out.  Hand check of the rule: a micro batch returns local_sum / N_global
x dp x n_micro; the schedule divides by n_micro, the ranks' mean divides by dp: sum_all / N_global.
The token-mean metrics (actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower, critic/vf_clipfrac,
critic/vpred_mean) go through the workers' own reduction (summarize_metrics per rank, reduce_metrics over
ranks): token-weighted, so equal for every split and equal to the fraction counted by hand.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf import algorithms as algos
from rlhf.config import compose_config
from parallel.forward import split_micro_batches
from parallel.optim import StepResult
from rlhf.workers import critic as critic_mod
from rlhf.workers import worker as worker_mod
from rlhf.workers.critic import CRITIC_TOKEN_MEANS, MegatronCritic
from rlhf.workers.losses import POLICY_TOKEN_MEANS, DPOLoss, PPOPolicyLoss
from rlhf.workers.worker import MegatronWorker, reduce_metrics, summarize_metrics

N, P, R, n = 16, 1, 5, 2  # 16 rows = 8 prompts x 2; mini batch of 4 prompts -> 2 optimizer steps
LENGTHS = [5, 1, 3, 0, 2, 4, 5, 3, 2, 2, 5, 1, 4, 3, 0, 5]
SPLITS = [(1, 8), (1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]  # (dp, micro batch rows); (1, 8) = reference


def ppo_batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1] * k + [0] * (R - k) for k in LENGTHS])
    loss_mask = mask.clone()
    loss_mask[5] = 0  # an excluded (unscorable / overlong-filtered) sample
    return {"input_ids": torch.arange(N).view(N, 1).repeat(1, P + R), "attention_mask": torch.ones(N, P + R),
            "position_ids": torch.zeros(N, P + R), "response_mask": mask, "loss_mask": loss_mask,
            "old_log_probs": -torch.rand(N, R, generator=g, dtype=torch.float64) - 0.5,
            "ref_log_probs": -torch.rand(N, R, generator=g, dtype=torch.float64) - 0.5,
            "advantages": torch.randn(N, R, generator=g, dtype=torch.float64),
            "values": torch.randn(N, R, generator=g, dtype=torch.float64),
            "returns": torch.randn(N, R, generator=g, dtype=torch.float64),
            "ref_logps": -5 * torch.rand(N, generator=g, dtype=torch.float64), "n": n, "prompt_length": P,
            "responses": torch.zeros(N, R, dtype=torch.long)}


class FakeMegatron:
    """forward_backward / zero_grads / optimizer_step of rlhf.workers.worker: outputs are rows of `table`."""

    def __init__(self, monkeypatch, kind, dp_rank, dp_size):
        g = torch.Generator().manual_seed(1)
        self.table = (-torch.rand(N, P + R, generator=g, dtype=torch.float64) - 0.3).requires_grad_()
        self.entropy = (torch.rand(N, P + R, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
        self.kind, self.grads, self.metrics = kind, [], []
        monkeypatch.setattr(worker_mod, "dp_info", lambda: (dp_rank, dp_size, None))
        monkeypatch.setattr(worker_mod, "forward_backward", self.forward_backward)
        monkeypatch.setattr(worker_mod, "zero_grads", self.zero_grads)
        monkeypatch.setattr(worker_mod, "optimizer_step", self.optimizer_step)

    def forward_backward(self, model, mb, *, forward_only, loss_fn, micro_batch_size, **kw):
        micros = split_micro_batches(mb, micro_batch_size)
        out = []
        for m in micros:
            rows = m["input_ids"][:, 0]
            outs = ({"values": self.table[rows]} if self.kind == "values"
                    else {"log_probs": self.table[rows], "entropy": self.entropy[rows]})
            loss, metrics = loss_fn(outs, m)
            (loss / len(micros)).backward()  # megatron's schedule
            out.append({k: float(v) for k, v in metrics.items()})
        return out

    def zero_grads(self, state):
        self.table.grad = self.entropy.grad = None

    def optimizer_step(self, state):
        self.grads.append(torch.cat([self.table.grad.flatten(), (self.entropy.grad if self.entropy.grad is not None
                                                                  else torch.zeros_like(self.entropy)).flatten()]))
        return StepResult(skipped=False, grad_norm=0.0, lr=0.0)


def run_split(monkeypatch, dp, micro, run, token_means=POLICY_TOKEN_MEANS + CRITIC_TOKEN_MEANS):
    """(per-step gradients averaged over the dp ranks, metrics as rlhf.workers.worker.gather_metrics reduces them:
    the mean over every micro batch of every rank, `token_means` token-weighted)."""
    grads, parts = [], []
    for rank in range(dp):
        fake = FakeMegatron(monkeypatch, "values" if run.__name__ == "critic" else "log_probs", rank, dp)
        parts.append(summarize_metrics(run(micro, fake), token_means))
        grads.append(torch.stack(fake.grads))
    return torch.stack(grads).mean(0), reduce_metrics(parts)


def actor_run(loss):
    def actor(micro, fake):
        w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
        per_micro, steps = w.train_mini_batches(
            ppo_batch(), ("input_ids", "attention_mask", "position_ids") + tuple(loss.keys),
            lambda outs, mb: loss(outs, mb, P), mini_batch_size=4, micro_batch_size_per_gpu=micro, epochs=1, step=1,
            micro_group=loss.micro_group, global_info=loss.global_info)
        assert len(steps) == 2
        return per_micro
    return actor


MODES = sorted(set(algos.POLICY_LOSS_REGISTRY) - {"clip_cov", "kl_cov"})


@pytest.mark.parametrize("agg", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_gradient_independent_of_micro_batches_and_dp(monkeypatch, mode, agg):
    actor = compose_config([f"actor.policy_loss.loss_mode={mode}", f"actor.loss_agg_mode={agg}",
                            "actor.entropy_coeff=0.01", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]).actor
    run = actor_run(PPOPolicyLoss(actor))
    ref_grad, ref_metrics = run_split(monkeypatch, *SPLITS[0], run)
    assert ref_grad.abs().sum() > 0
    for dp, micro in SPLITS[1:]:
        grad, metrics = run_split(monkeypatch, dp, micro, run)
        torch.testing.assert_close(grad, ref_grad, msg=f"dp={dp} micro={micro}")
        for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-9, abs=1e-12), (k, dp, micro)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_bypass_mode_with_is_weights_and_rejection_independent_of_micro_batches_and_dp(monkeypatch, agg):
    """Rollout correction's bypass mode (REINFORCE with token IS weights and token_k1 rejection computed inside the
    loss, per micro batch) gives the same gradient for every split."""
    rc = [f"algorithm.rollout_correction.{k}" for k in ("bypass_mode=true", "loss_type=reinforce", "rollout_is=token",
                                                         "rollout_is_threshold=1.05", "rollout_rs=token_k1",
                                                         "rollout_rs_threshold=0.9_1.1")]
    cfg = compose_config([*rc, f"actor.loss_agg_mode={agg}", "actor.entropy_coeff=0.01"])
    loss = PPOPolicyLoss(cfg.actor, rollout_correction=cfg.algorithm.rollout_correction)
    run = actor_run(loss)
    ref_grad, ref_metrics = run_split(monkeypatch, *SPLITS[0], run)
    assert ref_grad.abs().sum() > 0 and 0 < ref_metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    for dp, micro in SPLITS[1:]:
        grad, metrics = run_split(monkeypatch, dp, micro, run)
        torch.testing.assert_close(grad, ref_grad, msg=f"dp={dp} micro={micro}")
        assert metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], rel=1e-9, abs=1e-12)


def test_policy_loss_metric_is_the_mini_batch_loss(monkeypatch):
    """Token-mean vanilla loss of each mini batch by hand (on-policy: r = exp(table - old)), averaged over the
    two mini batches, equals actor/pg_loss for every split."""
    actor = compose_config([]).actor
    b, fake = ppo_batch(), FakeMegatron(monkeypatch, "log_probs", 0, 1)
    lp = fake.table.detach()[:, P:]
    ratio, adv = (lp - b["old_log_probs"]).exp(), b["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -3 * adv), pg)
    m = b["loss_mask"].bool()
    want = np.mean([float(pg[rows][m[rows]].mean()) for rows in (slice(0, 8), slice(8, 16))])
    for dp, micro in SPLITS:
        _, metrics = run_split(monkeypatch, dp, micro, actor_run(PPOPolicyLoss(actor)))
        assert metrics["actor/pg_loss"] == pytest.approx(want, rel=1e-9)


def _by_hand(clip_ratio_c):
    """pg_clipfrac, ppo_kl, pg_clipfrac_lower of the whole update counted by hand: clipped / dual-clipped loss tokens
    and the sum of (old - new) log-probs over the loss tokens of both mini batches, / their number (on-policy
    outputs: new = the table, so r = exp(table - old))."""
    with pytest.MonkeyPatch.context() as mp:  # (only for its table: the patches are undone at once)
        b, fake = ppo_batch(), FakeMegatron(mp, "log_probs", 0, 1)
    new, old, adv, m = fake.table.detach()[:, P:], b["old_log_probs"], b["advantages"], b["loss_mask"].bool()
    ratio = (new - old).exp()
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)
    dual = (torch.maximum(unclipped, clipped) > -adv * clip_ratio_c) & (adv < 0)
    n = int(m.sum())
    return int((clipped > unclipped)[m].sum()) / n, float((old - new)[m].sum()) / n, int(dual[m].sum()) / n


def test_ratio_metrics_are_token_weighted_for_every_split(monkeypatch):
    """actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower: masked sums over every micro batch and rank / the
    valid loss tokens, the same at micro batch 8, 4, 2 and 1 rows and 1 or 2 data-parallel ranks (before: a plain
    mean of micro batch means, pg_clipfrac 0.389 at 8 rows, 0.344 at 1 row; ppo_kl -0.301 and -0.220; a micro
    batch without loss tokens, rows 3, 5 and 14 here, counted as 0)."""
    actor = compose_config(["actor.clip_ratio_c=1.5"]).actor  # a low dual clip, so pg_clipfrac_lower is not 0
    clipfrac, kl, lower = _by_hand(1.5)
    assert (clipfrac, lower) == (16 / 41, 6 / 41) and kl == pytest.approx(-0.28910, abs=1e-5)  # 41 loss tokens
    for dp, micro in SPLITS:
        _, metrics = run_split(monkeypatch, dp, micro, actor_run(PPOPolicyLoss(actor)))
        assert metrics["actor/pg_clipfrac"] == pytest.approx(clipfrac, rel=1e-12), (dp, micro)
        assert metrics["actor/ppo_kl"] == pytest.approx(kl, rel=1e-12), (dp, micro)
        assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(lower, rel=1e-12), (dp, micro)
        assert "_loss_tokens" not in metrics


def test_token_weights_hold_for_unequal_micro_batch_counts_per_rank():
    """Dynamic batching cuts each rank's rows by a token budget, so ranks may run different numbers of micro
    batches: rank 0 two (3 tokens, mean 1/3; 1 token, mean 1), rank 1 one (0 tokens).  Token-weighted: (1 + 1) /
    4 = 0.5 whatever the cut; the plain mean of the three means would be 0.444; a plain metric stays a mean."""
    ranks = [[{"actor/pg_clipfrac": 1 / 3, "actor/pg_loss": 2.0, "_loss_tokens": 3},
              {"actor/pg_clipfrac": 1.0, "actor/pg_loss": 4.0, "_loss_tokens": 1}],
             [{"actor/pg_clipfrac": 0.0, "actor/pg_loss": 6.0, "_loss_tokens": 0}]]
    got = reduce_metrics([summarize_metrics(r, POLICY_TOKEN_MEANS) for r in ranks])
    assert got == {"actor/pg_clipfrac": pytest.approx(0.5, rel=1e-12), "actor/pg_loss": 4.0}
    assert reduce_metrics([summarize_metrics([{"actor/ppo_kl": 0.0, "_loss_tokens": 0}], POLICY_TOKEN_MEANS)]) == {
        "actor/ppo_kl": 0.0}  # no loss token anywhere: 0, as a masked mean of nothing


@pytest.mark.parametrize("agg", algos.LOSS_AGG_MODES)
def test_value_loss_gradient_independent_of_micro_batches_and_dp(monkeypatch, agg):
    cfg = compose_config([f"critic.loss_agg_mode={agg}", "critic.ppo_mini_batch_size=4"]).critic

    def critic(micro, fake):
        c = MegatronCritic(None, SimpleNamespace(model=None), SimpleNamespace(**{**cfg, "ppo_micro_batch_size_per_gpu":
                                                                                   micro}), forward_micro_batch_size=4)
        monkeypatch.setattr(critic_mod, "gather_metrics", lambda per_micro, *a: {"_per_micro": per_micro})
        monkeypatch.setattr(critic_mod, "step_metrics", lambda role, steps: {})
        return c.update_critic(ppo_batch(), step=1)["_per_micro"]

    ref_grad, ref_metrics = run_split(monkeypatch, *SPLITS[0], critic)
    assert ref_grad.abs().sum() > 0
    for dp, micro in SPLITS[1:]:
        grad, metrics = run_split(monkeypatch, dp, micro, critic)
        torch.testing.assert_close(grad, ref_grad, msg=f"dp={dp} micro={micro}")
        for k in ("critic/vf_loss",) + CRITIC_TOKEN_MEANS:
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-9, abs=1e-12), (k, dp, micro)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_gradient_independent_of_micro_batches_and_dp(monkeypatch, loss_type):
    """Pairs are rows (2i, 2i + 1); the loss is the mean over the mini batch's 4 pairs for every split (micro
    batches of whole pairs); IPO uses the response lengths (LENGTHS, the empty rows excluded below)."""
    loss = DPOLoss(SimpleNamespace(beta=0.5, label_smoothing=0.0, loss_type=loss_type))

    def dpo(micro, fake):
        b = ppo_batch()
        b["response_mask"] = b["response_mask"].clamp(min=1) if loss_type == "ipo" else b["response_mask"]
        w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
        per_micro, _ = w.train_mini_batches(
            b, ("input_ids", "attention_mask", "position_ids") + loss.keys, lambda outs, mb: loss(outs, mb, P),
            mini_batch_size=4, micro_batch_size_per_gpu=micro, epochs=1, step=1, micro_group=2,
            global_info=loss.global_info)
        return per_micro

    ref_grad, ref_metrics = run_split(monkeypatch, *SPLITS[0], dpo)
    assert ref_grad.abs().sum() > 0
    for dp, micro in [(1, 2), (1, 4), (2, 2), (2, 4)]:  # micro batches of whole pairs
        grad, metrics = run_split(monkeypatch, dp, micro, dpo)
        torch.testing.assert_close(grad, ref_grad, msg=f"dp={dp} micro={micro}")
        assert metrics["dpo/loss"] == pytest.approx(ref_metrics["dpo/loss"], rel=1e-9)


def test_loss_metrics_hold_when_ranks_run_different_numbers_of_micro_batches(monkeypatch):
    """Dynamic batching cuts each rank's rows by its own token budget: here rank 0 runs its 4 rows of a mini batch as
    4 micro batches, rank 1 as 1.  actor/pg_loss, actor/entropy and actor/kl_loss (each micro batch reports its share
    of the mini batch's loss x its rank's micro batch count k) must still be the mini batch's loss: each micro batch
    weighted 1 / k (rlhf.workers.worker.MICRO_SHARE_KEY).  Before: a plain mean over the 5 micro batches, which
    weights rank 0 by 4/5 (pg_loss 0.0740 instead of 0.0445 here) -- the gradient was right all along."""
    actor = compose_config(["actor.entropy_coeff=0.01", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]).actor
    loss = PPOPolicyLoss(actor)
    ref_grad, ref_metrics = run_split(monkeypatch, *SPLITS[0], actor_run(loss))
    ranks = {}

    def uneven(lengths, max_tokens, group=1):
        rank = ranks["now"]
        return [[i] for i in range(len(lengths))] if rank == 0 else [list(range(len(lengths)))]

    monkeypatch.setattr(worker_mod, "partition_by_token_budget", uneven)

    def actor_dynamic(micro, fake):
        ranks["now"] = len(ranks.setdefault("seen", [])) % 2
        ranks["seen"].append(1)
        w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=4)
        per_micro, steps = w.train_mini_batches(
            ppo_batch(), ("input_ids", "attention_mask", "position_ids") + tuple(loss.keys),
            lambda outs, mb: loss(outs, mb, P), mini_batch_size=4, micro_batch_size_per_gpu=micro, epochs=1, step=1,
            micro_group=1, global_info=loss.global_info, max_tokens_per_micro_batch=1000)
        assert len(per_micro) == (8 if ranks["now"] == 0 else 2)  # 2 mini batches: 4 + 4 micro batches, or 1 + 1
        return per_micro

    grad, metrics = run_split(monkeypatch, 2, 4, actor_dynamic)
    torch.testing.assert_close(grad, ref_grad)
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-9, abs=1e-12), k
    assert "_micro_share" not in metrics
