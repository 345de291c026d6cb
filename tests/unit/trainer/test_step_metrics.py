"""verl's step metrics (verl/trainer/ppo/metric_utils.py: compute_data_metrics, compute_timing_metrics,
compute_throughout_metrics, process_validation_metrics + ray_trainer's val-core / val-aux grouping), each value
hand-computed on a 2-sequence batch; the progress bar names the algorithm."""
from __future__ import annotations

import math

import pytest
import torch

from rlhf.config import compose_config
from rlhf.trainer.metrics import add_step_timing, compute_data_metrics, compute_timing_metrics, timer
from rlhf.trainer.ppo_trainer import algorithm_label
from rlhf.trainer.val_metrics import validation_metrics, verl_validation_metrics


def _batch():
    # P = 3, R = 3; row 0: prompt of 2 tokens, response of 3; row 1: prompt of 3, response of 1
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return {
        "prompt_length": 3, "response_mask": response_mask,
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]),  # sums 1.0, 0.5
        "token_level_rewards": torch.tensor([[-0.1, 0.0, 1.0], [0.5, 0.0, 0.0]]),  # sums 0.9, 0.5
        "advantages": torch.tensor([[1.0, 2.0, 3.0], [-1.0, 9.0, 9.0]]),  # valid: 1 2 3 -1
        "returns": torch.tensor([[1.0, 2.0, 3.0], [0.0, 7.0, 7.0]]),  # valid: 1 2 3 0
        "values": torch.tensor([[1.0, 1.0, 3.0], [1.0, 5.0, 5.0]]),  # valid: 1 1 3 1
        "old_log_probs": torch.zeros(2, 3),
        "rollout_log_probs": torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.0, 0.0]]),
        "ref_log_probs": torch.tensor([[-0.2, -0.2, -0.2], [-0.4, 0.0, 0.0]]),
    }


def test_compute_data_metrics_hand_computed():
    m = compute_data_metrics(_batch(), max_response_length=3, max_prompt_length=3)
    # returns - values over response tokens: 0 1 0 -1 -> unbiased var 2/3; returns 1 2 3 0 -> var 5/3
    explained = 1 - (2 / 3) / (5 / 3 + 1e-5)
    assert m == pytest.approx({
        "critic/score/mean": 0.75, "critic/score/max": 1.0, "critic/score/min": 0.5,
        "critic/rewards/mean": 0.7, "critic/rewards/max": 0.9, "critic/rewards/min": 0.5,
        "critic/advantages/mean": 1.25, "critic/advantages/max": 3.0, "critic/advantages/min": -1.0,
        "critic/returns/mean": 1.5, "critic/returns/max": 3.0, "critic/returns/min": 0.0,
        "critic/values/mean": 1.5, "critic/values/max": 3.0, "critic/values/min": 1.0,
        "critic/vf_explained_var": explained,
        "response_length/mean": 2.0, "response_length/max": 3.0, "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5, "response/aborted_ratio": 0.0,
        "response_length_non_aborted/mean": 2.0, "response_length_non_aborted/max": 3.0,
        "response_length_non_aborted/min": 1.0, "response_length_non_aborted/clip_ratio": 0.5,
        "prompt_length/mean": 2.5, "prompt_length/max": 3.0, "prompt_length/min": 2.0, "prompt_length/clip_ratio": 0.5,
        "actor/kl": (0.2 * 3 + 0.4) / 4, "actor/rollout_log_prob_diff": (0.1 * 3 + 0.3) / 4}, abs=1e-6)
    assert explained == pytest.approx(0.6, abs=1e-5)
    # the configured prompt limit, not the batch's padded width: no prompt of 3 tokens is clipped at 4
    assert compute_data_metrics(_batch(), 3, max_prompt_length=4)["prompt_length/clip_ratio"] == 0.0


def test_without_a_critic_there_are_no_value_metrics():
    batch = _batch()
    del batch["values"], batch["ref_log_probs"]
    m = compute_data_metrics(batch, 3)
    assert not any(k.startswith(("critic/values", "critic/vf_")) for k in m) and m["actor/kl"] == 0.0


def test_timing_per_token_and_throughput_hand_computed():
    m = {"timing_s/gen": 0.6, "timing_s/update_actor": 0.9, "timing_s/old_log_prob": 0.3,
         "timing_s/update_weights": 0.1}
    # gen per response token (4), the others per token of the batch (5 prompt + 4 response); verl has no
    # per-token old_log_prob / update_weights
    assert compute_timing_metrics(m, _batch()) == pytest.approx({"timing_per_token_ms/gen": 150.0,
                                                                 "timing_per_token_ms/update_actor": 100.0})
    out = add_step_timing({}, seconds=2.0, tokens=9.0, world_size=3)
    assert out == {"timing_s/step": 2.0, "perf/time_per_step": 2.0, "perf/total_num_tokens": 9.0,
                   "perf/throughput": 1.5}
    t = {}
    with timer(t, "adv"):
        pass
    assert list(t) == ["timing_s/adv"] and t["timing_s/adv"] >= 0.0


def test_val_core_and_aux_hand_computed():
    # source a: prompt 0 -> [1, 0, 1, 1], prompt 1 -> [0, 0] (fewer responses); source b: prompt 2 -> [0.5]
    groups = {"a": {0: [1.0, 0.0, 1.0, 1.0], 1: [0.0, 0.0]}, "b": {2: [0.5]}}
    m = verl_validation_metrics(groups)
    std4 = math.sqrt((3 * 0.25 ** 2 + 0.75 ** 2) / 4)  # population std of [1, 0, 1, 1]
    assert m == pytest.approx({"val-core/a/reward/mean@4": 0.75, "val-aux/a/reward/std@4": std4,
                               "val-aux/a/reward/mean@2": 0.0, "val-aux/a/reward/std@2": 0.0,
                               "val-core/b/reward/mean@1": 0.5})
    assert std4 == pytest.approx(0.4330127, abs=1e-7)
    full = validation_metrics(["x", "x", "x", "x"], [0, 0, 1, 1], [1.0, 0.0, 1.0, 1.0], n=2)
    assert full["val-core/x/reward/mean@2"] == 0.75 and full["val-aux/x/reward/std@2"] == 0.25
    assert full["val/x/score"] == 0.75  # ours stay


@pytest.mark.parametrize("overrides, label", [([], "PPO"), (["algorithm.adv_estimator=grpo"], "GRPO"),
                                              (["algorithm.adv_estimator=rloo"], "RLOO"),
                                              (["algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true"],
                                               "DAPO")])
def test_progress_bar_names_the_algorithm(overrides, label):
    assert algorithm_label(compose_config(overrides)) == label
