"""The metrics people look at, read back from TensorBoard: per-data-source validation scores and pass@k
(hand-computed), the table of sample generations, score / response-length histograms, rollout tokens/s, GPU
memory per phase (nothing on CPU); trainer.critic_warmup (the first steps update only the critic).  PPOTrainer's
validate / train_step run on fakes (tests/support/fakes.py): no engine, no megatron."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.config import compose_config
from rlhf.rollout.types import RolloutSample
from rlhf.trainer import metrics as step_metrics
from rlhf.trainer.ppo_trainer import PPOTrainer
from rlhf.trainer.tracking import Histogram, Table, Tracking
from rlhf.trainer.val_metrics import pass_at_k, pass_at_k_values, validation_metrics
from tests.support import tracking_readers as read
from rlhf.trainer.perf import PerfMeter
from tests.support.fakes import FakeActor, FakePromptLoader, FakeRollout
from tests.unit.trainer.test_perf_metrics import TINY_SPEC


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k_values(4) == [1, 2, 4] and pass_at_k_values(6) == [1, 2, 4, 6] and pass_at_k_values(1) == [1]
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_validation_metrics_per_data_source():
    # source a: prompt 0 -> [1, 0], prompt 1 -> [0, 0]; source b: prompt 2 -> [1, 1]
    m = validation_metrics(["a", "a", "a", "a", "b", "b"], [0, 0, 1, 1, 2, 2], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], n=2)
    assert m == pytest.approx({"val/score": 0.5, "val/a/score": 0.25, "val/b/score": 1.0,
                               "val/a/pass@1": (0.5 + 0) / 2, "val/a/pass@2": (1 + 0) / 2, "val/a/best@2": 0.5,
                               "val/b/pass@1": 1.0, "val/b/pass@2": 1.0, "val/b/best@2": 1.0,
                               # verl's: mean over prompts of their mean / population std of their 2 scores
                               "val-core/a/reward/mean@2": 0.25, "val-aux/a/reward/std@2": 0.25,
                               "val-core/b/reward/mean@2": 1.0, "val-aux/b/reward/std@2": 0.0})
    assert validation_metrics(["a", "b"], [0, 1], [0.5, 1.0], n=1) == {
        "val/score": 0.75, "val/a/score": 0.5, "val/b/score": 1.0, "val-core/a/reward/mean@1": 0.5,
        "val-core/b/reward/mean@1": 1.0}
    assert validation_metrics([], [], [], n=4) == {"val/score": 0.0}


class _Tok:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _item(i, source):
    return {"input_ids": [10 + i, 11], "data_source": source, "ground_truth": str(i), "extra_info": {}, "index": i,
            "raw_prompt": f"q{i}"}


def _samples(n_prompts, n):
    return [RolloutSample([10 + p, 11], [20 + p, 21 + k], [0.0, 0.0], "stop", p, k)
            for p in range(n_prompts) for k in range(n)]


def test_validate_logs_per_source_scores_pass_at_k_and_generations_to_tensorboard(tmp_path):
    cfg = compose_config(["rollout.val_kwargs.n=2", "trainer.log_val_generations=3", "data.val_batch_size=2"])
    val = [_item(0, "openai/gsm8k"), _item(1, "openai/gsm8k"), _item(2, "math")]
    # batch 1: prompts 0, 1 (gsm8k); batch 2: prompt 2 (math) -- the loader keeps the dataset's order
    rollout = FakeRollout([(_samples(2, 2), [1.0, 0.0, 0.0, 0.0], {}), (_samples(1, 2), [1.0, 1.0], {})])
    trainer = SimpleNamespace(cfg=cfg, val_dataset=val, rollout=rollout, reward="r", tokenizer=_Tok(),
                              off_policy=None)
    m = PPOTrainer.validate(trainer)
    assert [c[1] for c in rollout.calls] == ["val", "val"]
    table = m["val/generations"]
    assert isinstance(table, Table) and list(table.columns) == ["data_source", "prompt", "response", "score"]
    assert table.rows == [["openai/gsm8k", "10 11", "20 21", 1.0], ["openai/gsm8k", "10 11", "20 22", 0.0],
                          ["openai/gsm8k", "11 11", "21 21", 0.0]]

    tracker = Tracking(str(tmp_path / "tensorboard"), backends=["tensorboard"])
    tracker.log(m, 3)
    tracker.close()
    tb = read.tensorboard(str(tmp_path / "tensorboard"))
    assert tb["scalars"] == pytest.approx({
        ("val/score", 3): 0.5, ("val/openai/gsm8k/score", 3): 0.25, ("val/math/score", 3): 1.0,
        ("val/openai/gsm8k/pass@1", 3): 0.25, ("val/openai/gsm8k/pass@2", 3): 0.5, ("val/openai/gsm8k/best@2", 3): 0.5,
        ("val/math/pass@1", 3): 1.0, ("val/math/pass@2", 3): 1.0, ("val/math/best@2", 3): 1.0,
        ("val-core/openai/gsm8k/reward/mean@2", 3): 0.25, ("val-aux/openai/gsm8k/reward/std@2", 3): 0.25,
        ("val-core/math/reward/mean@2", 3): 1.0, ("val-aux/math/reward/std@2", 3): 0.0})
    text = tb["text"][("val/generations", 3)]
    assert text.count("| openai/gsm8k |") == 3 and "| 20 21 | 1 |" in text


def _train_trainer(cfg, results):
    trainer = object.__new__(PPOTrainer)
    trainer.cfg, trainer.tokenizer, trainer.reward = cfg, _Tok(), "r"
    trainer.train_loader = FakePromptLoader([{"batch": i} for i in range(len(results))])
    trainer.rollout = FakeRollout(results)
    trainer.actor, trainer.critic, trainer.reference = FakeActor(), FakeActor(), None
    trainer.kl_ctrl, trainer.policy_loss = None, "loss"
    trainer.perf = PerfMeter({"actor": TINY_SPEC, "critic": TINY_SPEC}, "cpu", 1, {"actor": 1, "critic": 1})
    return trainer


def test_train_step_histograms_tokens_per_s_and_critic_warmup(tmp_path):
    cfg = compose_config(["trainer.critic_warmup=1", "rollout.n=2", "data.max_response_length=4"])
    # prompt 0: responses of 2 and 3 tokens, prompt 1: 1 and 4 tokens
    samples = [RolloutSample([9, 9], [5] * k, [0.0] * k, "stop", p, i) for p, i, k in
               [(0, 0, 2), (0, 1, 3), (1, 0, 1), (1, 1, 4)]]
    trainer = _train_trainer(cfg, [(samples, [1.0, 0.0, 0.5, 1.0], {"reward/num_fallbacks": 0.0})] * 2)

    m1 = trainer.train_step(1)  # critic warm-up: critic updated, actor not, engines not re-synced
    assert trainer.critic.updates == [1] and trainer.actor.updates == [] and trainer.rollout.synced == 0
    assert "actor/pg_loss" not in m1 and "timing_s/update_actor" not in m1 and m1["critic/vf_loss"] == 0.25
    m2 = trainer.train_step(2)
    assert trainer.critic.updates == [1, 2] and trainer.actor.updates == [2] and trainer.rollout.synced == 1
    assert m2["actor/pg_loss"] == 0.5

    assert m2["perf/rollout_tokens_per_s"] == pytest.approx(10 / m2["timing_s/gen"])
    # verl's names: prompts of 2 tokens, responses of 2, 3, 1, 4 (max 4: one clipped); the critic's values are 0
    assert m2["prompt_length/mean"] == 2.0 and m2["prompt_length/clip_ratio"] == 0.0
    assert (m2["response_length/min"], m2["response_length/max"], m2["response_length/clip_ratio"]) == (1.0, 4.0, 0.25)
    assert m2["timing_per_token_ms/gen"] == pytest.approx(m2["timing_s/gen"] * 1000 / 10)
    assert m2["timing_per_token_ms/update_actor"] == pytest.approx(m2["timing_s/update_actor"] * 1000 / 18)
    assert m2["critic/values/max"] == 0.0 and "critic/vf_explained_var" in m2
    assert m2["critic/score/hist"].values == [1.0, 0.0, 0.5, 1.0]
    assert m2["response_length/hist"].values == [2.0, 3.0, 1.0, 4.0]
    assert not any(k.startswith("memory/") for k in m2)  # CPU: no GPU memory metrics
    m2.pop("_tokens")
    tracker = Tracking(str(tmp_path / "tensorboard"), backends=["tensorboard"])
    tracker.log(m2, 2)
    tracker.close()
    tb = read.tensorboard(str(tmp_path / "tensorboard"))
    assert tb["histograms"][("critic/score/hist", 2)] == (4, 2.5)  # (count, sum)
    assert tb["histograms"][("response_length/hist", 2)] == (4, 10.0)
    assert tb["scalars"][("perf/rollout_tokens_per_s", 2)] == pytest.approx(m2["perf/rollout_tokens_per_s"], rel=1e-6)


def test_timer_records_gpu_memory_per_phase_when_cuda_is_in_use(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 5 << 29)
    m = {}
    with step_metrics.timer(m, "update_actor"):
        pass
    assert calls == ["reset"]
    assert m["memory/update_actor/max_allocated_gb"] == 3.0 and m["memory/update_actor/max_reserved_gb"] == 2.5
    assert set(m) == {"timing_s/update_actor", "memory/update_actor/max_allocated_gb",
                      "memory/update_actor/max_reserved_gb"}


def test_rollout_metrics_are_media_and_a_rate():
    batch = {"response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
             "token_level_scores": torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])}
    m = step_metrics.rollout_metrics(batch, gen_seconds=0.5)
    assert isinstance(m["critic/score/hist"], Histogram) and m["perf/rollout_tokens_per_s"] == 6.0


def test_a_batch_with_no_scorable_sample_skips_the_updates_instead_of_crashing():
    """Bug: a reward outage (every sample unscorable) crashed GAE's whitening ("needs at least 2 valid
    entries").  Now the step logs training/no_scorable_samples=1 and neither trains nor re-syncs; the next
    step with scores trains as usual."""
    from rlhf.rewards.validity import SAMPLE_VALID_KEY

    cfg = compose_config(["rollout.n=2", "data.max_response_length=4", "algorithm.adv_estimator=gae"])
    samples = [RolloutSample([9, 9], [5] * k, [0.0] * k, "stop", p, i) for p, i, k in
               [(0, 0, 2), (0, 1, 3), (1, 0, 1), (1, 1, 4)]]
    outage = {"reward/num_fallbacks": 4.0, SAMPLE_VALID_KEY: [False] * 4}
    fine = {"reward/num_fallbacks": 0.0, SAMPLE_VALID_KEY: [True] * 4}
    trainer = _train_trainer(cfg, [(samples, [0.0] * 4, dict(outage)), (samples, [1.0, 0.0, 0.5, 1.0], dict(fine))])
    trainer.kl_ctrl = None
    m1 = trainer.train_step(1)
    assert m1["training/no_scorable_samples"] == 1.0 and m1["reward/num_unscorable"] == 4.0
    assert trainer.actor.updates == [] and trainer.critic.updates == [] and trainer.rollout.synced == 0
    assert m1["critic/advantages/mean"] == 0.0
    m2 = trainer.train_step(2)
    assert m2["training/no_scorable_samples"] == 0.0 and m2["reward/num_unscorable"] == 0.0
    assert trainer.actor.updates == [2] and trainer.critic.updates == [2] and trainer.rollout.synced == 1


def _four_samples():
    # prompt 0: responses of 2 and 3 tokens, prompt 1: 1 and 4 tokens
    return [RolloutSample([9, 9], [5] * k, [0.0] * k, "stop", p, i) for p, i, k in
            [(0, 0, 2), (0, 1, 3), (1, 0, 1), (1, 1, 4)]]


def test_dapo_overlong_penalty_is_in_critic_score_as_in_verl():
    """verl's DAPO reward manager (verl/workers/reward_manager/dapo.py) adds the overlong penalty to the score it
    puts in token_level_scores, and compute_data_metrics reads critic/score from there.  L_max 4, buffer 2, factor 1:
    responses of 2, 3, 1, 4 tokens get 0, -0.5, 0, -1; raw scores 1, 0, 0.5, 1 -> 1, -0.5, 0.5, 0: mean 0.25, min
    -0.5 (before: the raw scores, mean 0.625, min 0)."""
    cfg = compose_config(["rollout.n=2", "data.max_response_length=4", "reward.overlong_buffer.enable=true",
                          "reward.overlong_buffer.len=2", "reward.overlong_buffer.penalty_factor=1.0"])
    trainer = _train_trainer(cfg, [(_four_samples(), [1.0, 0.0, 0.5, 1.0], {"reward/num_fallbacks": 0.0})])
    m = trainer.train_step(1)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == pytest.approx((0.25, 1.0, -0.5))
    assert m["critic/score/hist"].values == pytest.approx([1.0, -0.5, 0.5, 0.0])
    assert m["dapo/overlong_penalty/mean"] == pytest.approx(-0.375) and m["dapo/overlong_frac"] == 0.5


def test_train_step_logs_verls_step_metrics_and_the_console_prints_them_all(tmp_path, caplog):
    """verl's names that were missing: timing_s/reward (the reward's seconds, out of timing_s/gen),
    timing_s/update_weights (the weight sync), response/aborted_ratio, response_length_non_aborted/*,
    perf/mfu/actor and perf/mfu/critic (update FLOPs / (seconds x peak x devices), rlhf.trainer.perf),
    perf/max_memory_allocated_gb; and every scalar reaches the console (before: 13 chosen names)."""
    import logging

    cfg = compose_config(["rollout.n=2", "data.max_response_length=4"])
    trainer = _train_trainer(cfg, [(_four_samples(), [1.0, 0.0, 0.5, 1.0],
                                    {"reward/num_fallbacks": 0.0, "timing_s/reward": 0.25})])
    m = trainer.train_step(1)
    assert m["timing_s/reward"] == 0.25 and m["timing_s/gen"] >= 0.0 and "timing_s/update_weights" in m
    assert m["response/aborted_ratio"] == 0.0 and m["response_length_non_aborted/mean"] == 2.5
    # every sequence: 2 prompt + its response tokens -> lengths 4, 5, 3, 6 (rlhf.trainer.perf.update_flops)
    from rlhf.trainer.perf import DEVICE_PEAK_FLOPS, update_flops

    for role in ("actor", "critic"):
        want = update_flops(TINY_SPEC, [4, 5, 3, 6]) / (m[f"timing_s/update_{role}"] * DEVICE_PEAK_FLOPS["CPU"])
        assert m[f"perf/mfu/{role}"] == pytest.approx(want, rel=1e-9) and m[f"perf/mfu/{role}"] > 0
    assert m["perf/max_memory_allocated_gb"] > 0.05  # this process's peak RSS (torch alone is more than 50 MiB)

    m.pop("_tokens")
    scalars = {k for k, v in m.items() if not isinstance(v, (Histogram, Table))}
    assert len(scalars) > 40
    with caplog.at_level(logging.INFO, logger="rlhf.metrics"):
        logging.getLogger().addHandler(handler := logging.NullHandler())  # logging configured: lines via logging
        try:
            tracker = Tracking(str(tmp_path / "tb"), backends=["console"])
            tracker.log(m, 1)
            tracker.close()
        finally:
            logging.getLogger().removeHandler(handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlhf.metrics"]
    printed = [item.split(":")[0] for line in lines for item in line[len("step 1: "):].split(" - ")]
    assert all(line.startswith("step 1: ") for line in lines)
    assert sorted(printed) == printed and set(printed) == scalars  # every scalar once, sorted
    assert len(lines) == len({k.split("/")[0] for k in scalars})  # one line per section
    assert "critic/score/mean:0.625" in " ".join(lines)


def test_remax_baseline_scoring_counts_as_reward_time():
    """ReMax scores a greedy response per prompt too: its seconds go into timing_s/reward, out of timing_s/gen."""
    cfg = compose_config(["rollout.n=2", "data.max_response_length=4", "algorithm.adv_estimator=remax"])
    greedy = [RolloutSample([9, 9], [5, 5], [0.0, 0.0], "stop", p, 0) for p in (0, 1)]
    trainer = _train_trainer(cfg, [(_four_samples(), [1.0, 0.0, 0.5, 1.0], {"timing_s/reward": 0.25}),
                                   (greedy, [1.0, 0.0], {"timing_s/reward": 0.5})])
    trainer.critic = None
    from rlhf.rollout.sampling import SamplingConfig

    trainer.rollout.train_sampling = SamplingConfig(n=2)
    m = trainer.train_step(1)
    assert m["timing_s/reward"] == 0.75 and "remax/baseline_score/mean" in m
