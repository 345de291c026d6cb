"""Every policy loss and advantage estimator runs 3 steps through the PPO trainer
(CPU, the tiny quickstart model) and writes finite metrics to TensorBoard.

One process builds one PPOTrainer (recipe grpo_tiny_cpu, small batches) and runs PPOTrainer.train_step three
times per (loss mode, estimator) pair, switching ``actor.policy_loss.loss_mode`` and ``algorithm.adv_estimator``
in its config between pairs (the trainer reads both per step; the policy loss is rebuilt from the config).
Every run also exercises the issue-10 wiring: a reward that fails on ~1 in 5 responses (unscorable samples
excluded, reward/num_unscorable), ``algorithm.overlong_filter``, the adaptive KL controller in the reward
(reference model), and ReMax's greedy baseline rollout.

The rollouts come from tests/support/hf_sampling_engine.py, an in-process engine double fed by the real weight
bridge after every step (on-policy), so no Ray / SGLang start is paid for a test of the algorithms; the
real engine runs these algorithms with ``ZOO_ENGINE=sglang`` (the engine itself is covered by
tests/e2e/test_trainer_e2e.py, tests/e2e/test_algorithms_e2e.py).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.tracking_readers import run_series as scalars

from tests.support.paths import ROOT

pytestmark = [pytest.mark.slow]

# every new loss mode once, every new estimator at least once
COMBOS = [("gspo", "grpo"), ("cispo", "remax"), ("sapo", "opo"), ("gpg", "gpg"), ("geo_mean", "grpo_passk"),
          ("clip_cov", "rloo_vectorized"), ("kl_cov", "grpo_vectorized")]
STEPS = 3

FLAKY_REWARD = """
import zlib
from rlhf.rewards.registry import call_reward_fn, get_reward_fn

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if zlib.crc32(solution_str.encode()) % 5 == 0:
        raise RuntimeError("reward service unavailable")
    return call_reward_fn(get_reward_fn(data_source), data_source, solution_str, ground_truth, extra_info)
"""

DRIVER = """
import json, os, sys, time
t0 = time.time()
if os.environ.get("ZOO_ENGINE") != "sglang":  # the engine double (tests/support/hf_sampling_engine.py)
    import rlhf.workers.rollout
    from tests.support.hf_sampling_engine import start_hf_sampling_engine
    rlhf.workers.rollout.start_rollout = start_hf_sampling_engine
from rlhf.config import compose_config, validate_config
from rlhf.trainer.ppo_trainer import PPOTrainer
from rlhf.trainer.tracking import Tracking
from rlhf.workers.losses import PPOPolicyLoss

combos, overrides, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
cfg = compose_config(overrides, recipe="grpo_tiny_cpu")
validate_config(cfg, world_size=1)
trainer = PPOTrainer(cfg)
trainer.tracker = Tracking.from_config(cfg, enabled=True)  # as fit() does
print(f"READY {time.time() - t0:.1f}", flush=True)
step = 0
try:
    for loss_mode, estimator in combos:
        cfg.actor.policy_loss.loss_mode, cfg.algorithm.adv_estimator = loss_mode, estimator
        validate_config(cfg, world_size=1)
        trainer.policy_loss = PPOPolicyLoss(cfg.actor)
        for _ in range(steps):
            step += 1
            t1 = time.time()
            metrics = trainer.train_step(step)
            metrics.pop("_tokens")
            trainer.tracker.log(metrics, step)
            print("STEP " + json.dumps({"step": step, "loss_mode": loss_mode, "estimator": estimator,
                                        "loss_fn": trainer.policy_loss.policy_loss_fn.__name__,
                                        "seconds": round(time.time() - t1, 1),
                                        **{k[9:]: round(v, 2) for k, v in metrics.items()
                                           if k.startswith("timing_s/")}}),
                  flush=True)
finally:
    trainer.close()
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf.quickstart.model import build_quickstart_model

    # a third of the quickstart warm-up: the model answers some of the problems, enough for mixed groups
    return build_quickstart_model(str(tmp_path_factory.mktemp("tiny") / "model"), warmup_steps=100)


def test_new_loss_modes_and_estimators_run_through_the_trainer(tiny_model, tmp_path):
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(FLAKY_REWARD)
    out_dir = tmp_path / "zoo"
    overrides = [f"model.path={tiny_model}", f"trainer.default_local_dir={out_dir}", "trainer.logger=[tensorboard]",
                 "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=1",
                 "actor.ppo_micro_batch_size_per_gpu=4", f"reward.custom_reward_function.path={reward}",
                 "reward.fallback.type=constant",  # a failed sample stays unscorable (no rule fallback scores it)
                 "algorithm.overlong_filter=true", "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.5", "algorithm.kl_ctrl.horizon=100",
                 "trainer.val_before_train=false", "trainer.progress_bar=false"]
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), json.dumps(COMBOS), json.dumps(overrides), str(STEPS)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    print(next(line for line in out.splitlines() if line.startswith("READY ")))  # start-up seconds (pytest -s)
    ran = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("STEP ")]
    for r in ran:  # seconds per step and per phase (pytest -s)
        print(r)
    assert [(r["loss_mode"], r["estimator"]) for r in ran] == [c for c in COMBOS for _ in range(STEPS)]
    assert all(r["loss_fn"] == f"compute_policy_loss_{r['loss_mode']}" for r in ran)

    s = scalars(out_dir)
    total = len(COMBOS) * STEPS
    required = ["actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
                "critic/advantages/mean", "critic/score/mean", "actor/rollout_log_prob_diff",
                "actor/reward_kl_penalty_seq", "actor/reward_kl_penalty_coeff", "reward/num_fallbacks",
                "reward/num_unscorable", "actor/num_overlong_filtered", "timing_s/update_actor"]
    for tag in required:
        assert sorted(s.get(tag, {})) == list(range(1, total + 1)), tag
    for tag, by_step in s.items():  # every metric written is finite
        assert all(math.isfinite(v) for v in by_step.values()), (tag, by_step)
    for i, (mode, est) in enumerate(COMBOS):
        steps = range(i * STEPS + 1, (i + 1) * STEPS + 1)
        if mode not in ("gpg", "kl_cov"):  # GPG has no ratio to clip, KL-Cov penalises instead of clipping
            assert all(k in s["actor/pg_clipfrac"] for k in steps), mode
        if est == "remax":  # the greedy baseline rollout ran and was scored every step
            assert all(k in s["remax/baseline_score/mean"] for k in steps)
        if est == "grpo_passk":  # every advantage is max_j R_j - max_{j != i} R_j >= 0 (0 but for the best)
            assert all(s["critic/advantages/mean"][k] >= 0 for k in steps)
    # the failing reward made some samples unscorable; they were counted (and fell back)
    assert sum(s["reward/num_unscorable"].values()) > 0
    # (ReMax: a prompt whose greedy baseline fell back leaves its n samples out too)
    baseline = s.get("reward/baseline_num_fallbacks", {})
    assert all(s["reward/num_fallbacks"][k] + 4 * baseline.get(k, 0) >= s["reward/num_unscorable"][k]
               for k in range(1, total + 1))
    # the rollouts came from the weights of the step before (the bridge fed the engine every step): the
    # trainer's old log-probs equal the engine's
    assert max(s["actor/rollout_log_prob_diff"].values()) < 1e-3
    # the adaptive controller moved beta from its initial 0.001
    assert s["actor/reward_kl_penalty_coeff"][total] != pytest.approx(0.001, rel=1e-6)
