"""End-to-end PPO run through `python -m rlhf.main` on CPU (real SGLang engine, megatron actor and critic): the
GSM8K tiny recipe on the real GSM8K prompts at PP2 with dynamic batching.  METRICS: the metrics every PPO run logs.

Elsewhere: a killed run resumed bitwise equal to an uninterrupted one (tests/e2e/test_fault_matrix.py), the recipe at
TP2 as the one-node command, two nodes and under Slurm (tests/e2e/test_ray_cluster_local.py, tests/e2e/test_slurm_local.py)."""
import os

import pytest

from tests.support.dist_utils import main_cmd, run_group
from tests.support.tracking_readers import run_scalars

from tests.support.paths import ROOT
GSM8K = os.path.abspath(os.path.join(ROOT, "..", "shared", "data", "gsm8k"))

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

METRICS = ["critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm",
           "critic/advantages/mean", "response_length/mean", "actor/kl", "timing_s/gen", "timing_s/update_actor",
           "timing_s/update_critic", "timing_s/sync_weights", "actor/reward_kl_penalty", "perf/throughput",
           "perf/padding_efficiency"]
# dynamic batching (token budgets of 2 x (512 + 32), compacted rows) on the PP2 run
DYNAMIC = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=1088", "critic.use_dynamic_bsz=true",
           "critic.ppo_max_token_len_per_gpu=1088"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf.quickstart.model import build_quickstart_model

    return build_quickstart_model(str(tmp_path_factory.mktemp("tiny") / "model"), warmup_steps=40)


def run_main(overrides, nproc=1, timeout=900):
    """Run the trainer in its own process group (tests/dist_utils.run_group); fails unless it exits 0."""
    rc, out = run_group(main_cmd(overrides, nproc), timeout)
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    return out


@pytest.mark.dist
@pytest.mark.skipif(not os.path.exists(os.path.join(GSM8K, "train.jsonl")), reason="shared GSM8K not present")
def test_gsm8k_tiny_cpu_recipe_pp2_dynamic_bsz(tiny_model, tmp_path):
    layout = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2", *DYNAMIC]
    out = tmp_path / "run"
    run_main(["recipe=gsm8k_ppo_tiny_cpu", f"model.path={tiny_model}", f"trainer.default_local_dir={out}",
              f"data.train_files={GSM8K}/train.jsonl", f"data.val_files={GSM8K}/test.jsonl",
              "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=2",
              "trainer.val_before_train=false", "trainer.progress_bar=false", "data.max_val_samples=4",
              *layout], nproc=2)
    s = run_scalars(out)
    for tag in METRICS + ["val/score"]:
        assert any(t == tag for t, _ in s), f"metric {tag} missing"
    assert s[("response_length/mean", 2)] > 0
    # GSM8K tiny through token-budget micro batches: >= 0.92 real tokens per processed (0.80 padded)
    assert s[("perf/padding_efficiency", 2)] >= 0.92 and s[("perf/packing_fallback_micro_batches", 2)] > 0
    export = out / "hf_export"  # PP2 writes one shard per stage plus an index
    assert (export / "config.json").exists() and list(export.glob("model*.safetensors"))
