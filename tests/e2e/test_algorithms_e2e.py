"""End-to-end runs of the issue-5 algorithms on CPU with the tiny quickstart model (built once here):

* GRPO through the Python API example of docs/api.md (recipe quickstart, real SGLang engine): no
  critic is built, the sampled validation score rises, and a flaky custom reward (raises / hangs)
  plus a reward model in its own Ray worker run every step without stopping training, the
  fallbacks counted in reward/num_fallbacks;
* DPO (`recipe=quickstart algorithm.name=dpo`) on generated preference pairs: no rollout engine,
  preference accuracy and validation loss improve, checkpoints resume.
"""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from tests.support.dist_utils import run_group
from tests.support.tracking_readers import run_series as scalars

from tests.support.paths import ROOT

pytestmark = [pytest.mark.slow]

# a quarter of the samples fail: the first of the h == 1 ones (once per process: each hang costs a step
# reward.timeout_s) hangs past reward.timeout_s, the others raise
FLAKY_REWARD = """
import time, zlib
HUNG = []
def compute_score(solution_str, ground_truth):
    h = zlib.crc32(solution_str.encode()) % 8
    if h == 1 and not HUNG:
        HUNG.append(1)
        time.sleep(5)  # past reward.timeout_s
    if h in (0, 1):
        raise RuntimeError("reward service unavailable")
    return 1.0
"""


@pytest.fixture(scope="module")
def tiny_model(quickstart_model):
    return quickstart_model()


def run(cmd, timeout=900):
    """Run in its own process group with no torchrun rank variables inherited; fails on a non-zero exit."""
    rc, out = run_group(cmd, timeout, {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None})
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    return out


@pytest.mark.sglang
def test_grpo_quickstart_python_api(tiny_model, tmp_path):
    from tests.unit.rewards.test_reward_sources import make_tiny_rm

    rm = make_tiny_rm(tmp_path / "rm")
    flaky = tmp_path / "flaky_reward.py"
    flaky.write_text(FLAKY_REWARD)
    out_dir = tmp_path / "grpo"
    script = tmp_path / "api_example.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from rlhf import Trainer

        trainer = Trainer(algorithm="grpo", recipe="quickstart", output_dir={str(out_dir)!r},  # docs/api.md
                          # tiny, short settings for the test:
                          actor_model={tiny_model!r}, total_training_steps=12, test_freq=6, save_freq=6,
                          progress_bar=False, timeout_s=1.5,  # generous: the Ray reward model must not time out under load
                          reward_model=[{{"type": "rule", "weight": 1.0}},
                                        {{"type": "custom", "path": {str(flaky)!r}, "weight": 0.0}},
                                        {{"type": "model", "path": {rm!r}, "weight": 0.0, "placement": "ray"}}],
                          **{{"rollout.n": 4, "actor.optim.lr": 2e-4, "rollout.val_kwargs.temperature": 1.0,
                              "rollout.val_kwargs.n": 4}})
        metrics = trainer.run()
        print("FINAL_METRICS " + json.dumps(metrics))
    """))
    out = run([sys.executable, str(script)])
    final = json.loads(out.split("FINAL_METRICS ", 1)[1].splitlines()[0])
    # no critic anywhere
    assert not any(k.startswith("critic/v") for k in final) and "critic.enable=true with" not in out
    for step in (6, 12):
        ckpt = out_dir / "checkpoints" / f"global_step_{step}"
        assert (ckpt / "actor").is_dir() and not (ckpt / "critic").exists()
    s = scalars(out_dir)
    assert sorted(s["actor/pg_loss"]) == list(range(1, 13))  # every step ran
    # the sampled (T=1, 4 per prompt) validation score improves
    assert s["val/score"][12] >= s["val/score"][0] + 0.04, s["val/score"]
    # the failing reward never stopped training and is counted; the reward model ran every step
    assert all(s["reward/num_fallbacks"][k] > 0 for k in range(1, 13))
    # every fallback is counted against its source: the flaky custom reward each step; the Ray reward
    # model only if it was slower than timeout_s (possible while its worker warms up on a loaded machine)
    assert all(s["reward/custom/num_fallbacks"][k] > 0 for k in range(1, 13))
    per_source = [t for t in s if t.startswith("reward/") and t.endswith("/num_fallbacks") and t.count("/") == 2]
    assert "reward/custom/num_fallbacks" in per_source and "reward/model/num_fallbacks" in per_source
    assert all(s["reward/num_fallbacks"][k] == sum(s[t][k] for t in per_source) for k in range(1, 13))
    assert len(s["reward/model/mean"]) == 12
    assert "reward/num_fallbacks=" in out  # on the console too
    assert "compute_score timed out (1.5s, reward.timeout_s)" in out, out[-4000:]  # the hang: a fallback too


def test_dpo_quickstart_on_generated_pairs(tiny_model, tmp_path):
    from rlhf.data.preference import write_preference_parquet
    from rlhf.quickstart.arithmetic import make_synthetic_preference_dataset, quickstart_task_kwargs

    pairs = write_preference_parquet(make_synthetic_preference_dataset(640, seed=5, **quickstart_task_kwargs()),
                                     tmp_path / "pairs" / "train.parquet")
    out_dir = tmp_path / "dpo"
    common = ["recipe=quickstart", "algorithm.name=dpo", f"model.path={tiny_model}", f"data.train_files={pairs}",
              "data.val_files=embedded://preference", "data.train_batch_size=16",
              "actor.ppo_mini_batch_size=16", "actor.optim.lr=3e-4", f"trainer.default_local_dir={out_dir}",
              "trainer.test_freq=20", "trainer.save_freq=20", "trainer.progress_bar=false"]
    out = run([sys.executable, "-m", "rlhf.main", *common, "trainer.total_training_steps=40"])
    assert "Ray" not in out and "sglang" not in out.lower()  # no rollout engine
    s = scalars(out_dir)
    acc, loss = s["val/preference_accuracy"], s["val/dpo_loss"]
    assert acc[0] == 0.0 and acc[40] >= 0.65, acc  # implicit reward of chosen > rejected
    assert loss[40] < loss[0] - 0.1, loss
    for tag in ("dpo/loss", "dpo/accuracy", "dpo/margin", "dpo/chosen_rewards", "actor/grad_norm"):
        assert sorted(s[tag]) == list(range(1, 41)), tag
    assert (out_dir / "hf_export" / "model.safetensors").exists()
    # checkpoints resume (actor, optimizer, data position)
    out = run([sys.executable, "-m", "rlhf.main", *common, "trainer.total_training_steps=42",
               "trainer.val_before_train=false", "trainer.export_hf_at_end=false"])
    assert "resumed from" in out and "global_step_40" in out
    assert sorted(scalars(out_dir)["dpo/loss"]) == list(range(1, 43))
