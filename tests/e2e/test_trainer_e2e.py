"""End-to-end PPO run through `python -m rlhf.main` on CPU (real SGLang engine, megatron actor and critic): the
GSM8K tiny recipe on the real GSM8K prompts at PP2 with dynamic batching.  METRICS: the metrics every PPO run logs.

The same run is the rollout seam's test through the trainer: its engine is killed as step 2 generates
(RLHF_FAULT=rollout_engine_death@2); the manager replaces it and the new engine is re-synced with the latest weights
(both pipeline stages' buckets) before it generates, every sync read back (`rollout.weight_sync_check=true`), and
the run completes with the restart counted.

Elsewhere: a killed run resumed bitwise equal to an uninterrupted one (tests/e2e/test_fault_matrix.py), the recipe at
TP2 as the one-node command, two nodes and under Slurm (tests/e2e/test_ray_cluster_local.py, tests/e2e/test_slurm_local.py),
disaggregated mode through the trainer (2 trainer ranks at TP2 broadcasting into the engine's weight-update group,
every sync read back) in the last two; the critic warm-up step (colocated engine, validation right after it) in the
CPU dry run of scripts/gpu_smoke.py (tests/e2e/test_gpu_smoke.py)."""
import os

import pytest

from tests.support.dist_utils import finish_group, main_cmd, start_group
from tests.support.tracking_readers import run_scalars

from tests.support.paths import ROOT
GSM8K = os.path.abspath(os.path.join(ROOT, "..", "shared", "data", "gsm8k"))

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

METRICS = ["critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm",
           "critic/advantages/mean", "response_length/mean", "actor/kl", "timing_s/gen", "timing_s/update_actor",
           "timing_s/update_critic", "timing_s/update_weights", "actor/reward_kl_penalty", "perf/throughput",
           "perf/padding_efficiency",
           # issue 42: verl's names that were missing (rlhf.trainer.metrics, rlhf.trainer.perf, BaseTrainer.fit)
           "timing_s/reward", "training/global_step", "training/epoch", "response/aborted_ratio", "perf/mfu/actor",
           "perf/mfu/critic", "perf/max_memory_allocated_gb"]
# dynamic batching (token budgets of 2 x (512 + 32), compacted rows) on the PP2 run
DYNAMIC = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=1088", "critic.use_dynamic_bsz=true",
           "critic.ppo_max_token_len_per_gpu=1088"]


@pytest.fixture(scope="module")
def tiny_model(quickstart_model):
    return quickstart_model(warmup_steps=40)


@pytest.mark.dist
@pytest.mark.skipif(not os.path.exists(os.path.join(GSM8K, "train.jsonl")), reason="shared GSM8K not present")
def test_gsm8k_tiny_cpu_recipe_pp2_dynamic_bsz_engine_killed_after_step_1(tiny_model, tmp_path):
    layout = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2", *DYNAMIC]
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_group(main_cmd(["recipe=gsm8k_ppo_tiny_cpu", f"model.path={tiny_model}",
                                 f"trainer.default_local_dir={out}", f"data.train_files={GSM8K}/train.jsonl",
                                 f"data.val_files={GSM8K}/test.jsonl", "trainer.total_training_steps=2",
                                 "trainer.save_freq=2", "trainer.test_freq=2", "trainer.val_before_train=false",
                                 "trainer.progress_bar=false", "data.max_val_samples=4",
                                 "rollout.weight_sync_check=true", *layout], nproc=2), log,
                       # the engine dies as step 2's generate call starts (rlhf.faults; a killer thread that
                       # watched the log for step 1's line lost the race against a fast step 2 in CI)
                       env={"RLHF_FAULT": "rollout_engine_death@2", "RLHF_FAULT_RANK": "0"})
    rc = finish_group(proc, 900)
    text = open(log).read()
    assert rc == 0, f"exit {rc}:\n{text[-6000:]}"
    s = run_scalars(out)
    for tag in METRICS + ["val/score", "timing_s/testing", "timing_s/save_checkpoint"]:
        assert any(t == tag for t, _ in s), f"metric {tag} missing"
    assert any(t.startswith("val-core/") for t, k in s if k == 2)
    assert 0 < s[("perf/mfu/actor", 2)] < 1 and s[("training/global_step", 2)] == 2
    assert s[("response_length/mean", 2)] > 0
    # GSM8K tiny through token-budget micro batches: >= 0.92 real tokens per processed (0.80 padded)
    assert s[("perf/padding_efficiency", 2)] >= 0.92 and s[("perf/packing_fallback_micro_batches", 2)] > 0
    export = out / "hf_export"  # PP2 writes one shard per stage plus an index
    assert (export / "config.json").exists() and list(export.glob("model*.safetensors"))
    # the engine killed as step 2 began generating was replaced; step 2 generated on the new engine after its
    # re-sync (read back: rollout.weight_sync_check fails the run on a mismatch)
    assert "FAULT rollout_engine_death: killing rollout engine 0" in text, text[-3000:]
    assert "rollout engine 0 died" in text, text[-3000:]
    assert s[("rollout/num_restarts", 1)] == 0 and s[("rollout/num_restarts", 2)] == 1
    assert ("critic/score/mean", 2) in s
