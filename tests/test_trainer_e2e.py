"""End-to-end PPO runs through `python -m rlhf.main` on CPU (real SGLang engine, megatron actor and
critic): a killed-and-resumed run equals an uninterrupted one; real GSM8K prompts at TP2 and PP2."""
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_utils import main_cmd, run_group
from tests.tracking_readers import run_scalars

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GSM8K = os.path.abspath(os.path.join(ROOT, "..", "shared", "data", "gsm8k"))

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

METRICS = ["critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm",
           "critic/advantages/mean", "response_length/mean", "actor/kl", "timing/gen", "timing/update_actor",
           "timing/update_critic", "timing/sync_weights", "actor/reward_kl_penalty", "perf/throughput",
           "perf/padding_efficiency"]
# issue 9: dynamic batching (token budgets of 2 x (512 + 32), compacted rows) on the PP2 run
DYNAMIC = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=1088", "critic.use_dynamic_bsz=true",
           "critic.ppo_max_token_len_per_gpu=1088"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf.quickstart.model import build_quickstart_model

    return build_quickstart_model(str(tmp_path_factory.mktemp("tiny") / "model"), warmup_steps=40)


def run_main(overrides, nproc=1, env=None, expect_rc=0, timeout=900):
    """Run the trainer in its own process group (tests/dist_utils.run_group) and check its exit code."""
    rc, out = run_group(main_cmd(overrides, nproc), timeout, env)
    assert rc == expect_rc, f"exit {rc}:\n{out[-6000:]}"
    return out


def common(model, out_dir, steps):
    return ["recipe=quickstart", f"model.path={model}", f"trainer.default_local_dir={out_dir}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=2", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2",
            # greedy rollouts: SGLang's seeded sampling needs deterministic inference, which its CPU
            # (torch_native) backend does not offer; everything else is seeded and restored
            "rollout.temperature=0", "data.max_response_length=12"]


def test_resume_equals_uninterrupted(tiny_model, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    run_main(common(tiny_model, full, 4))
    # the second run dies abruptly at the start of step 3, right after the step-2 checkpoint
    run_main(common(tiny_model, killed, 4), env={"RLHF_FAIL_AT_STEP": "3"}, expect_rc=17)
    assert (killed / "checkpoints" / "global_step_2").is_dir()
    assert not (killed / "hf_export").exists()
    out = run_main(common(tiny_model, killed, 4))  # resume_mode=auto
    assert "resumed from" in out and "global_step_2" in out
    a = load_file(str(full / "hf_export" / "model.safetensors"))
    b = load_file(str(killed / "hf_export" / "model.safetensors"))
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    init = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert any(not torch.equal(a[k], init[k]) for k in a), "training did not change the weights"
    sa, sb = run_scalars(full), run_scalars(killed)
    for tag in ["critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm"]:
        for step in (3, 4):
            assert sa[(tag, step)] == sb[(tag, step)], (tag, step, sa[(tag, step)], sb[(tag, step)])
    # checkpoints: only the last max_ckpt_to_keep (2) complete ones, no leftovers
    names = sorted(os.listdir(killed / "checkpoints"))
    assert names == ["global_step_2", "global_step_4", "latest_checkpointed_iteration.txt"], names
    for tag in METRICS:
        assert (tag, 4) in sa, f"metric {tag} not logged"


@pytest.mark.dist
@pytest.mark.skipif(not os.path.exists(os.path.join(GSM8K, "train.jsonl")), reason="shared GSM8K not present")
@pytest.mark.parametrize("layout", [["parallel.tensor_model_parallel_size=2"],
                                    ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
                                     *DYNAMIC]],
                         ids=["tp2", "pp2_dynamic_bsz"])
def test_gsm8k_tiny_cpu_recipe(tiny_model, tmp_path, layout):
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
    if DYNAMIC[0] in layout:  # GSM8K tiny through token-budget micro batches: >= 0.92 real tokens per processed
        assert s[("perf/padding_efficiency", 2)] >= 0.92 and s[("perf/packing_fallback_micro_batches", 2)] > 0
    else:
        assert 0 < s[("perf/padding_efficiency", 2)] < 0.92
    export = out / "hf_export"  # PP2 writes one shard per stage plus an index
    assert (export / "config.json").exists() and list(export.glob("model*.safetensors"))
