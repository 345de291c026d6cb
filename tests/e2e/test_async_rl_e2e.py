"""Issue 40's first parts through ``python -m rlhf.main recipe=quickstart`` on CPU (real SGLang engine under Ray,
megatron actor + critic, the tiny quickstart model built once here):

* rollout correction: ``algorithm.rollout_correction.rollout_is=token`` logs verl's ``rollout_corr/`` metrics
  (IS weights, off-policy diagnostics) and the training-inference mismatch metrics (``training/rollout_probs_diff_*``);
* one-step off-policy with ``staleness: 0`` (generation started through the background thread, collected, weights
  synced at the step boundary) reproduces the synchronous trainer's metrics exactly;
* fully async (``async_training.*``): killed mid-stream and resumed, no prompt trained twice or lost;
* one-step off-policy with ``staleness: 1``, validation while a batch is in flight, killed (SIGKILL, the whole process
  group) at the start of step 4 with batch 4 in flight, then resumed: batch 4's prompts are drawn again and
  generated from the resumed weights; every step trains a different prompt batch (none twice, none lost); the
  staleness of steps 2-3 is 1, of the regenerated step 4 is 0.
"""
import re

import pytest

from tests.support.dist_utils import finish_group, main_cmd, run_group, start_group
from tests.support.tracking_readers import run_series

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

COMMON = ["recipe=quickstart", "trainer.progress_bar=false", "trainer.val_before_train=false",
          "trainer.export_hf_at_end=false", "trainer.logger=[console,tensorboard]"]
#: metrics that measure time, speed or memory (they differ between any two runs), or exist in one mode only
UNTIMED = re.compile(r"^(timing_s/|timing_per_token_ms/|perf/|memory/|weight_sync/|async/)")


@pytest.fixture(scope="module")
def tiny_model(quickstart_model):
    return quickstart_model()


def _run(args, env=None, expect_rc=0):
    rc, out = run_group(main_cmd(args), 900, {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, **(env or {})})
    assert rc == expect_rc, f"exit {rc}:\n{out[-6000:]}"
    return out


def test_rollout_correction_metrics_and_staleness_zero_equals_sync(tiny_model, tmp_path):
    # the two runs at once (their start-ups and engine boots overlap); each in a process group of its own
    procs = {}
    for name, extra in (("sync", []), ("off0", ["trainer.one_step_off_policy.enable=true",
                                                 "trainer.one_step_off_policy.staleness=0"])):
        args = [*COMMON, f"model.path={tiny_model}", f"trainer.default_local_dir={tmp_path / name}",
                "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1",
                "algorithm.rollout_correction.rollout_is=token", *extra]
        procs[name] = start_group(main_cmd(args), tmp_path / f"{name}.log",
                                  {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None})
    rcs = {name: finish_group(proc, 900) for name, proc in procs.items()}
    for name, rc in rcs.items():
        log = (tmp_path / f"{name}.log").read_text()
        assert rc == 0, f"{name}: exit {rc}:\n{log[-6000:]}"
    sync, off0 = run_series(str(tmp_path / "sync")), run_series(str(tmp_path / "off0"))
    for tag in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/kl",
                "rollout_corr/k3_kl", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl", "rollout_corr/chi2_token",
                "training/rollout_probs_diff_mean", "training/rollout_actor_probs_pearson_corr"):
        assert set(sync[tag]) == {1, 2}, tag
    # the engine and the trainer agree closely on CPU: IS weights ~1, no truncation
    assert sync["rollout_corr/rollout_is_mean"][1] == pytest.approx(1.0, abs=1e-3)
    assert sync["rollout_corr/rollout_is_ratio_fraction_high"][1] == 0.0
    # staleness 0: the synchronous trainer's numbers, exactly
    compared = sorted(t for t in sync if not UNTIMED.match(t))
    assert "actor/pg_loss" in compared and "critic/vf_loss" in compared and len(compared) > 60
    assert {t: off0.get(t) for t in compared} == {t: sync[t] for t in compared}
    assert off0["async/staleness/max"] == {1: 0.0, 2: 0.0}


def test_one_step_off_killed_with_a_batch_in_flight_resumes_without_losing_it(tiny_model, tmp_path):
    out = tmp_path / "off1"
    args = [*COMMON, f"model.path={tiny_model}", f"trainer.default_local_dir={out}", "trainer.total_training_steps=4",
            "trainer.save_freq=1", "trainer.test_freq=2", "trainer.one_step_off_policy.enable=true",
            "algorithm.rollout_correction.rollout_is=token"]
    killed = _run(args, env={"RLHF_FAULT": "step_start@4", "RLHF_FAULT_RANK": "0"}, expect_rc=-9)
    assert "FAULT step_start hit 4" in killed
    started = dict(re.findall(r"started step (\d+)'s prompts (\[[^\]]*\])", killed))
    trained = re.findall(r"step (\d+) trains prompts (\[[^\]]*\]), generated from weight version (\d+) \(actor "
                         r"version (\d+)\)", killed)
    assert [(s, v, a) for s, _, v, a in trained] == [("1", "0", "0"), ("2", "0", "1"), ("3", "1", "2")]
    assert "4" in started  # batch 4 was generating when the run was killed
    resumed = _run(args)
    assert "resumed from" in resumed
    again = re.findall(r"step (\d+) trains prompts (\[[^\]]*\]), generated from weight version (\d+) \(actor "
                       r"version (\d+)\)", resumed)
    assert again == [("4", started["4"], "3", "3")]  # drawn again, generated from the resumed actor
    batches = [p for _, p, _, _ in trained] + [again[0][1]]
    assert len(set(batches)) == 4  # four different prompt batches: none trained twice, none lost
    s = run_series(str(out))
    assert s["async/staleness/max"][2] == 1.0 and s["async/staleness/max"][3] == 1.0
    assert s["async/staleness/max"][4] == 0.0 and "val/score" in s and 2 in s["val/score"]


def test_fully_async_killed_mid_stream_resumes_without_training_a_prompt_twice_or_losing_one(tiny_model, tmp_path):
    """Fully async (async_training.*, partial rollout in chunks of 4 tokens, staleness_threshold 1): killed (SIGKILL)
    at the start of step 4 with prompts queued and generating, resumed: the prompts drawn and not trained at the
    step-3 checkpoint are generated again first; 6 steps x 4 prompts train 24 different prompts."""
    out = tmp_path / "fully_async"
    args = [*COMMON, "algorithm=grpo", f"model.path={tiny_model}", f"trainer.default_local_dir={out}",
            "trainer.total_training_steps=6", "trainer.save_freq=1", "trainer.test_freq=-1", "data.train_batch_size=4",
            "async_training.enable=true", "async_training.require_batches=1", "async_training.staleness_threshold=1",
            "async_training.trigger_parameter_sync_step=1", "async_training.partial_rollout_chunk_tokens=4"]
    killed = _run(args, env={"RLHF_FAULT": "step_start@4", "RLHF_FAULT_RANK": "0"}, expect_rc=-9)
    assert "FAULT step_start hit 4" in killed
    trained = re.findall(r"fully async: step (\d+) trains prompts \[([^\]]*)\]", killed)
    assert [s for s, _ in trained] == ["1", "2", "3"]
    pending = re.findall(r"fully async: checkpoint keeps pending prompts \[([^\]]*)\]", killed)[-1]
    resumed = _run(args)
    assert "resumed from" in resumed
    assert f"fully async: resumed with pending prompts [{pending}]" in resumed
    again = re.findall(r"fully async: step (\d+) trains prompts \[([^\]]*)\]", resumed)
    assert [s for s, _ in again] == ["4", "5", "6"]
    ids = [int(i) for _, p in trained + again for i in p.split(",")]
    assert len(ids) == 24 and len(set(ids)) == 24  # none trained twice
    later = {int(i) for _, p in again for i in p.split(",")}
    assert {int(i) for i in pending.split(",")} <= later  # none lost: every pending prompt trained after the resume
    s = run_series(str(out))
    assert max(s["async/staleness/max"].values()) <= 3.0 and set(s["async/staleness/max"]) == set(range(1, 7))
