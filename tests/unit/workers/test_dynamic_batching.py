"""Dynamic batching (actor/critic.use_dynamic_bsz, token-budget micro batches, compacted rows).

- hand-computed partitions, compaction and its inverse;
- the GSM8K tiny recipe's batches (real GSM8K prompts through the recipe's dataset settings and the tiny tokenizer,
  responses = the GSM8K answers cut at data.max_response_length, 4 prompts x n=2 per step) reach
  perf/padding_efficiency >= 0.92 through the worker's real counting path, against ~0.80 padded;
- on a tiny megatron model (one process, gloo): old log-probs of the dynamic path equal the padded path's
  (max |diff| <= 1e-5) and one PPO update gives the same loss and gradient norm;
- with megatron replaced by its arithmetic (tests/unit/workers/test_update_split_invariance.py's FakeMegatron), the gradient of
  every optimizer step is the same for any token budget.
"""
from __future__ import annotations

import json
from types import SimpleNamespace
import pytest
import torch

from rlhf.workers import worker as worker_mod
from rlhf.workers.batch import build_batch
from rlhf.workers.dynamic_batch import check_token_budget, compact_rows, expand_rows, partition_by_token_budget
from rlhf.workers.worker import MegatronWorker, padding_metrics

GSM8K = "/work/shared/data/gsm8k/train.jsonl"
BUDGET = 1088  # 2 x (data.max_prompt_length 512 + data.max_response_length 32) of recipe gsm8k_ppo_tiny_cpu


def test_partition_hand_values():
    # sorted longest first: rows 2, 4 (8), 0 (5), 1 (3), 3 (2), 5 (1); budget 16 = rows x longest
    assert partition_by_token_budget([5, 3, 8, 2, 8, 1], 16) == [[2, 4], [0, 1, 3], [5]]
    # a generous budget: one micro batch; the smallest cap with that count is used (same single part)
    assert partition_by_token_budget([5, 3, 8], 100) == [[0, 1, 2]]
    # balanced: 4 rows of 4 with budget 12 -> 2 parts; cheapest largest part is 2 x 4 = 8, i.e. [2, 2] not [3, 1]
    assert partition_by_token_budget([4, 4, 4, 4], 12) == [[0, 1], [2, 3]]
    # rows alone: 6 | 3, 2 | 2 (budget 8); the same count fits a cap of 6 = 2 x 3
    assert partition_by_token_budget([3, 6, 2, 2], 8) == [[1], [0, 2], [3]]
    # groups (DPO pairs) stay together, costed at their longer row: 2 x 6 | 2 x 2
    assert partition_by_token_budget([3, 6, 2, 2], 12, group=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="budget is 7"):
        partition_by_token_budget([3, 8], 7)
    with pytest.raises(ValueError, match="groups of 2"):
        partition_by_token_budget([3, 8, 1], 20, group=2)
    with pytest.raises(ValueError, match=r"actor.ppo_max_token_len_per_gpu=100 .* >= 544"):
        check_token_budget("actor.ppo_max_token_len_per_gpu", 100, 512, 32)


def test_compact_and_expand_rows_hand_values():
    b = build_batch([[7, 8], [9], [4, 4, 4]], [[5, 2], [6, 6, 2], []], pad_token_id=0, max_response_length=4)
    rows, index = compact_rows({k: b[k] for k in ("input_ids", "attention_mask", "position_ids", "response_mask")})
    assert rows["input_ids"].tolist() == [[7, 8, 5, 2], [9, 6, 6, 2], [4, 4, 4, 0]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert rows["position_ids"][:, :3].tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    assert rows["response_mask"] is b["response_mask"]  # other keys untouched
    assert index.tolist() == [[1, 2, 3, 4], [2, 3, 4, 5], [0, 1, 2, 7]]  # 7 = S: padding
    out = torch.arange(12.0).view(3, 4).requires_grad_()
    full = expand_rows(out, index, 7)
    assert full.tolist() == [[0, 0, 1, 2, 3, 0, 0], [0, 0, 4, 5, 6, 7, 0], [8, 9, 10, 0, 0, 0, 0]]
    full.sum().backward()  # differentiable; padding outputs get no gradient
    assert out.grad.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]


@pytest.fixture(scope="module")
def gsm8k_steps():
    """The recipe's training batches: (prompt ids, response ids) of 4 GSM8K prompts x 2 per step, 16 steps."""
    from rlhf.config import compose_config
    from rlhf.data.rl_dataset import RLHFDataset
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer

    cfg = compose_config([], recipe="gsm8k_ppo_tiny_cpu")
    d, n = cfg.data, cfg.rollout.n
    tok = make_quickstart_tokenizer()
    ds = RLHFDataset(GSM8K, tok, d.max_prompt_length, max_samples=d.max_train_samples)
    with open(GSM8K) as f:
        answers = {i: json.loads(line)["answer"] for i, line in enumerate(f) if i < 4 * d.max_train_samples}
    items = [ds[i] for i in range(len(ds))]
    pairs = [(it["input_ids"], (tok(answers[it["index"]])["input_ids"] + [tok.eos_token_id])[:d.max_response_length])
             for it in items]
    bs = d.train_batch_size
    steps = [[pairs[i] for i in range(s, s + bs) for _ in range(n)] for s in range(0, len(pairs) - bs + 1, bs)]
    return steps, tok.pad_token_id, d.max_response_length, cfg


def _efficiency(monkeypatch, steps, pad_id, R, budget):
    """perf/padding_efficiency of the old-log-prob forward over the recipe's steps, megatron replaced by zeros."""
    monkeypatch.setattr(worker_mod, "dp_info", lambda: (0, 1, None))
    monkeypatch.setattr(worker_mod, "pipeline_micro_batch_multiple", lambda: 1)
    monkeypatch.setattr(worker_mod, "forward_backward",
                        lambda chunks, mb, **kw: {"log_probs": torch.zeros(mb["input_ids"].shape)})
    w = MegatronWorker(SimpleNamespace(chunks=None), forward_micro_batch_size=8, forward_max_tokens=budget)
    for rows in steps:
        b = build_batch([p for p, _ in rows], [r for _, r in rows], pad_id, R)
        out = w.forward(b)
        assert out["log_probs"].shape == b["input_ids"].shape
    return padding_metrics([w])


def test_gsm8k_tiny_padding_efficiency(monkeypatch, gsm8k_steps):
    steps, pad_id, R, cfg = gsm8k_steps
    assert len(steps) == 16 and len(steps[0]) == 8
    padded = _efficiency(monkeypatch, steps, pad_id, R, None)
    dynamic = _efficiency(monkeypatch, steps, pad_id, R, BUDGET)
    print(f"GSM8K tiny: padding efficiency padded {padded['perf/padding_efficiency']:.4f}, dynamic "
          f"(budget {BUDGET}) {dynamic['perf/padding_efficiency']:.4f}, fallback micro batches "
          f"{dynamic['perf/packing_fallback_micro_batches']:.0f}")
    assert dynamic["perf/padding_efficiency"] >= 0.92
    assert padded["perf/padding_efficiency"] < 0.85 and "perf/packing_fallback_micro_batches" not in padded
    assert dynamic["perf/packing_fallback_micro_batches"] > len(steps)  # > 1 micro batch per step


# ------------------------------------------------------------------ a real tiny megatron model, one process
@pytest.fixture(scope="module")
def tiny_actor(tmp_path_factory, gsm8k_steps):
    from parallel.distributed import set_seed
    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state
    from rlhf.quickstart.tiny import make_tiny_hf_model
    from tests.support.dist_utils import one_rank_grid
    from transformers import AutoConfig

    with one_rank_grid(tmp_path_factory.mktemp("pg")):
        set_seed(0)
        path = tmp_path_factory.mktemp("tiny")
        make_tiny_hf_model(path, kind="llama_gqa", vocab_size=400, hidden_size=32, num_layers=2,
                           max_position_embeddings=1024)
        bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", str(path))
        state = build_train_state(bundle.chunks, bundle.config, OptimConfig(lr=0.0, clip_grad=1e9))
        yield bundle, state


def _actor(bundle, state, budget):
    from rlhf.config import compose_config
    from rlhf.workers.actor import MegatronActor

    dynamic = ["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={budget}"] if budget else []
    cfg = compose_config(["actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
                          "actor.log_prob_micro_batch_size_per_gpu=8", "actor.entropy_coeff=0.01", *dynamic]).actor
    return MegatronActor(bundle, state, cfg)


def test_dynamic_equals_padded_on_tiny_megatron(tiny_actor, gsm8k_steps):
    from rlhf.workers.losses import PPOPolicyLoss

    bundle, state = tiny_actor
    steps, pad_id, R, _ = gsm8k_steps
    rows = steps[0]
    batch = build_batch([p for p, _ in rows], [r for _, r in rows], pad_id, R)
    batch["n"] = 2
    padded_actor, dynamic_actor = _actor(bundle, state, None), _actor(bundle, state, 600)
    lp_padded = padded_actor.compute_log_prob(batch)["log_probs"]
    lp_dynamic = dynamic_actor.compute_log_prob(batch)["log_probs"]
    assert lp_padded.shape == (8, R) and bool((lp_padded[batch["response_mask"].bool()] < 0).all())
    assert (lp_dynamic - lp_padded).abs().max().item() <= 1e-5
    assert dynamic_actor.padding.fallback_micro_batches >= 4  # 600-token budget: <= 2 rows of ~300 per micro batch

    g = torch.Generator().manual_seed(0)
    batch["old_log_probs"] = lp_padded + 0.05 * torch.randn(lp_padded.shape, generator=g)
    batch["advantages"] = torch.randn(lp_padded.shape, generator=g) * batch["response_mask"]
    batch["loss_mask"] = batch["response_mask"].clone()
    loss = PPOPolicyLoss(padded_actor.cfg)
    m_padded = padded_actor.update_policy(batch, loss, step=1)  # lr 0: the weights stay as they are
    m_dynamic = dynamic_actor.update_policy(batch, loss, step=1)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert m_dynamic[key] == pytest.approx(m_padded[key], rel=1e-5, abs=1e-7), key
    assert padding_metrics([dynamic_actor])["perf/padding_efficiency"] >= 0.92


# ------------------------------------------------------------------ split invariance, megatron's arithmetic
@pytest.mark.parametrize("budget", [6, 12, 18, 48])
def test_policy_gradient_independent_of_token_budget(monkeypatch, budget):
    from rlhf.config import compose_config
    from rlhf.workers.losses import PPOPolicyLoss
    from tests.unit.workers.test_update_split_invariance import actor_run, run_split

    cfg = compose_config(["actor.entropy_coeff=0.01"]).actor
    loss = PPOPolicyLoss(cfg)
    monkeypatch.setattr(worker_mod, "pipeline_micro_batch_multiple", lambda: 1)
    ref_grads, ref_metrics = run_split(monkeypatch, 1, 8, actor_run(loss))
    original = MegatronWorker.train_mini_batches

    def dynamic(self, *a, **kw):
        return original(self, *a, max_tokens_per_micro_batch=budget, **kw)

    monkeypatch.setattr(MegatronWorker, "train_mini_batches", dynamic)
    for dp in (1, 2):
        grads, metrics = run_split(monkeypatch, dp, 8, actor_run(loss))
        torch.testing.assert_close(grads, ref_grads, rtol=1e-9, atol=1e-12)
        assert metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], rel=1e-9)


def test_bad_dynamic_batching_settings_are_refused_before_building():
    from rlhf.config import compose_config
    from rlhf.workers.build import check_dynamic_batching

    cfg = compose_config(["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=64",
                          "data.max_prompt_length=64", "data.max_response_length=16"])
    with pytest.raises(ValueError, match=r"actor.log_prob_max_token_len_per_gpu=64 .* >= 80"):
        check_dynamic_batching(cfg, "actor")
    check_dynamic_batching(cfg, "critic")  # critic.use_dynamic_bsz is off: nothing to check
    cfg = compose_config(["critic.use_dynamic_bsz=true", "parallel.pipeline_model_parallel_size=2",
                          "parallel.virtual_pipeline_model_parallel_size=2"])
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2"):
        check_dynamic_batching(cfg, "critic")
