"""Fault-injection matrix: SIGKILL at the dangerous points of a PPO run on CPU (quickstart model,
greedy rollouts, real SGLang engine under Ray), then ``trainer.resume_mode=auto``.

One uninterrupted reference run of 3 steps, then ONE chain of runs in another directory, each killed at the
next point (rlhf/faults.py) and resumed by the next, the last one finishing:

    A  ckpt_mid_save@3   the trainer process ALONE (as the OOM killer), in the middle of step 2's sharded save
                         (actor tensor files written, metadata.json not): its children (Ray, the SGLang engine,
                         dist_checkpointing's writer) must go by themselves                       -> fresh
    B  sync_weights@K    the whole process group, in step 3's weight sync after its first bucket: K = 2 x
                         (buckets per sync) + 1 (the resume sync and step 2's come first), the buckets per
                         sync read from run A's RLHF_FAULT_TRACE lines (the reference run's must agree) -> step 1
    C  no fault: resumes from step 2 and finishes step 3                                             -> step 2

The other states a killed save can leave (a complete .tmp before its rename, renamed before the tracker was
written) are resumed from the tracker's step in tests/unit/trainer/test_fault_points.py (fast); the whole-group kill
between steps is the same mechanism as B.

Checked: the kill lands where asserted (the FAULT line, the checkpoint folder left behind), every resume
starts from the last COMPLETE checkpoint (never a .tmp or a folder the tracker does not name), no process
of a killed run survives it (the whole process tree seen while it ran -- trainer, Ray GCS/raylet/workers/
agents, the SGLang engine and its scheduler, dist_checkpointing's Manager -- plus every process carrying
the run's tag in its environment, checked with psutil), and the final weights (HF export), the step
metrics of steps 1-3 and the safeguard counters equal the reference run's bitwise; the chain runs with every
offload on (OFFLOAD: the actor's parameters, gradients and optimizer state, the reference's and the critic's,
parallel/offload.py), the reference run without, so the bitwise equality also shows that offload changes nothing
(and that checkpoints save and resume offloaded roles); the reference run logs every
metric of a PPO run (tests/e2e/test_trainer_e2e.METRICS).  The figures are
printed as one ``FAULT MATRIX`` line.

The reference run also triggers each of the seed's safeguards and shows its counter in TensorBoard:
rollout fault tolerance (RLHF_FAULT=rollout_request_error@3: the engine aborts step 1's 3rd request, which
is regenerated greedily -> rollout/num_fallbacks = 1 at step 1; greedy, so the same response), reward-model
degradation (reward_model_slow@1: a local reward model of weight 0 stalls 6 s > reward.timeout_s=2 on its
first call -> its 8 samples get the rule fallback, reward/model/num_fallbacks = 8 at step 1), the gradient
circuit breaker (actor.optim.breaker.grad_norm tiny: fires every 2 optimizer steps, once per step) and an
alert (actor/entropy above 0 fires every step).  Cost: 4 runs, each starting an SGLang engine; the
reference run runs alongside the chain (its checks come last), and the orphan wait of the trainer-alone kill (a
watcher thread) overlaps the runs after it.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_trainer_e2e import METRICS
from tests.support.tracking_readers import run_scalars

from tests.support.paths import ROOT
TAG_ENV = "RLHF_TEST_RUN_TAG"
# a killed run's processes must all be gone within this many seconds: at once when the whole process group is
# killed (the SGLang engine, in a session of its own, follows its Ray worker within ~1 s); when the trainer ALONE is
# killed, Ray's dashboard / runtime-env agents exit ~61 s later (Ray 2.60 reports the raylet's death over a GCS
# RPC with a fixed 60 s timeout first)
GRACE_S = {"group": 30, "process": 90}

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

# (label, RLHF_FAULT, RLHF_FAULT_MODE, step it must resume from (None: fresh), what it must leave behind)
CHAIN = [
    ("A mid sharded save (trainer alone)", "ckpt_mid_save@3", "process", None, "tmp2_partial"),
    ("B weight sync between buckets", "sync_weights@{hit}", "group", 1, "tracker2"),
]
STEPS = 3
# every role's offload on in the chain's runs (the reference run keeps everything on the device)
OFFLOAD = [f"{role}.offload.{part}=true" for role in ("actor", "critic") for part in ("params", "grads", "optimizer")]
OFFLOAD.append("actor.ref_param_offload=true")
# the reference run's safeguards (see the module docstring)
SAFEGUARD_FAULTS = {"RLHF_FAULT": "rollout_request_error@3,reward_model_slow@1", "RLHF_FAULT_STALL_S": "6",
                    "RLHF_FAULT_TRACE": "1"}
EQUAL_TAGS = ["critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm", "actor/lr",
              "critic/advantages/mean", "response_length/mean", "actor/num_breaker_events", "alerts/num_fired",
              "alerts/total"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The quickstart model at hidden 128 (1.6 MB of fp32 weights: with rollout.weight_sync_bucket_mb=1, two
    0.5 MiB buffers (the overlapped sync's halves), several buckets per weight sync) and a tiny reward model."""
    from rlhf.quickstart.model import build_quickstart_model
    from tests.unit.rewards.test_reward_sources import make_tiny_rm

    root = tmp_path_factory.mktemp("tiny")
    return (build_quickstart_model(str(root / "model"), warmup_steps=40, hidden_size=128),
            make_tiny_rm(root / "rm"))


def overrides(model, out_dir, extra=()):
    model_path, rm_path = model
    # actor.use_kl_loss: a reference model (offloaded in the chain)
    return ["recipe=quickstart", "actor.use_kl_loss=true", f"model.path={model_path}",
            f"trainer.default_local_dir={out_dir}",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2",
            "rollout.temperature=0",  # greedy: SGLang's CPU backend has no deterministic seeded sampling
            "data.max_response_length=12", "rollout.weight_sync_bucket_mb=1",
            # check mode: SGLang's generic loading in buckets, each a fault point (zero copy, the CPU default, writes
            # the engines' parameters in one pass without buckets)
            "rollout.weight_sync_check=true",
            "actor.optim.breaker.grad_norm=1e-6", "actor.optim.breaker.steps=2",
            "trainer.alerts=[{metric: actor/entropy, above: 0.0}]", "reward.timeout_s=2",
            f"reward.sources=[{{type: rule, weight: 1.0}}, {{type: model, path: '{rm_path}', weight: 0.0, "
            f"placement: local}}]", *extra]


def _ident(p):
    try:
        return p.pid, p.create_time(), " ".join(p.cmdline())[:120]
    except Exception:  # noqa: BLE001 - gone or unreadable
        return None


def _tagged(tag):
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_ENV) == tag:
                out.append(_ident(p))
        except Exception:  # noqa: BLE001 - gone, zombie, or another user's
            pass
    return [x for x in out if x]


def _alive(pid, created):
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launch(args, env_extra, log_dir, timeout=1500):
    """Run the trainer in a new session; record every process of the run while it runs (its process tree
    and every process whose environment carries the run's tag).  Returns (rc, output, processes, seconds)."""
    import psutil

    tag = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **{TAG_ENV: tag}, **env_extra)
    env["RAY_memory_monitor_refresh_ms"] = "0"  # other jobs on a shared test machine must not get engines killed
    seen, t0, last_scan = {}, time.monotonic(), 0.0
    log_path = os.path.join(log_dir, f"run_{tag}.log")
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlhf.main", *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            root = psutil.Process(proc.pid)
            while proc.poll() is None and time.monotonic() - t0 < timeout:
                try:
                    for c in [root, *root.children(recursive=True)]:
                        if (i := _ident(c)):
                            seen[(i[0], i[1])] = i[2]
                except psutil.NoSuchProcess:
                    pass
                if time.monotonic() - last_scan > 2:
                    seen.update({(i[0], i[1]): i[2] for i in _tagged(tag)})
                    last_scan = time.monotonic()
                time.sleep(0.5)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        finally:
            seconds = time.monotonic() - t0
        log.seek(0)
        out = log.read()
    os.unlink(log_path)
    return rc, out, {"tag": tag, "seen": seen}, seconds


def leftovers(procs, grace_s=GRACE_S["group"]):
    """Processes of a finished run still alive after up to `grace_s` seconds -> (list, seconds until none was
    left).  Whatever is left is killed afterwards (so a failure does not leak processes)."""
    t0 = time.monotonic()
    while True:
        left = [(pid, cmd) for (pid, created), cmd in procs["seen"].items() if _alive(pid, created)]
        left += [(pid, cmd) for pid, created, cmd in _tagged(procs["tag"]) if (pid, cmd) not in left]
        if not left or time.monotonic() - t0 > grace_s:
            break
        time.sleep(0.5)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left, time.monotonic() - t0


def check_left_behind(ckpt, what):
    names = sorted(os.listdir(ckpt))
    tracker = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()
    if what == "tmp2_partial":  # step 2's actor tensors written, its metadata.json not
        assert tracker == "1" and "global_step_2.tmp" in names and "global_step_2" not in names, names
        actor = os.path.join(ckpt, "global_step_2.tmp", "actor")
        assert glob.glob(os.path.join(actor, "*.distcp")) and not os.path.exists(os.path.join(actor, "metadata.json"))
    else:
        assert tracker == what[-1], (what, tracker, names)
        assert not [n for n in names if n.endswith((".tmp", ".deleting"))], names


def buckets_per_sync(out):
    """From RLHF_FAULT_TRACE lines: the number of sync_weights passes (buckets) of each weight sync."""
    lasts = [m.group(1) == "True" for m in re.finditer(r"FAULT-TRACE sync_weights \d+ last=(True|False)", out)]
    counts, n = [], 0
    for last in lasts:
        n += 1
        if last:
            counts.append(n)
            n = 0
    return counts


def test_fault_matrix(model, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    log_dir = str(tmp_path)
    t_start = time.monotonic()
    full, chain = tmp_path / "full", tmp_path / "chain"
    # the reference run alongside the chain (it needs nothing of it); a trainer-alone kill's orphans watched for
    # GRACE_S["process"] while the chain goes on (Ray's agents leave ~61 s after the trainer)
    pool = ThreadPoolExecutor(2)
    reference = pool.submit(launch, overrides(model, full), SAFEGUARD_FAULTS, log_dir)
    figures = {"faults_injected": 0, "runs_resumed": 0, "orphans_left": 0, "orphans_gone_after_s": {}}
    watched = []  # (label, future of leftovers(), killed at)

    def check_orphans(label, left, gone_after_s):
        figures["orphans_left"] += len(left)
        figures["orphans_gone_after_s"][label[0]] = round(gone_after_s, 1)  # seconds from the kill until none left
        assert not left, f"{label}: processes of the killed run survive it: {left}"

    run_seconds, buckets = [], None
    for label, fault, mode, resume_from, left_behind in CHAIN:
        if "{hit}" in fault:  # run A's trace tells how many buckets a sync has (checked against the reference's)
            fault = fault.format(hit=2 * buckets + 1)
        trace = {"RLHF_FAULT_TRACE": "1"} if buckets is None else {}
        rc, out, procs, secs = launch(overrides(model, chain, OFFLOAD), {"RLHF_FAULT": fault, "RLHF_FAULT_MODE": mode,
                                                                         **trace}, log_dir)
        killed_at = time.monotonic()
        run_seconds.append(secs)
        point = fault.split("@")[0]
        assert rc == -signal.SIGKILL, f"{label}: exit {rc}\n{out[-6000:]}"
        assert re.search(rf"FAULT {point} hit \d+ .*: SIGKILL process", out), out[-4000:]
        if point == "sync_weights":
            assert re.search(r"FAULT sync_weights hit \d+ last=False", out)  # after the first bucket, before the last
        if buckets is None:
            counts = buckets_per_sync(out)
            assert counts and len(set(counts)) == 1, counts  # every sync before the kill: the same plan
            assert counts[0] >= 2, f"one bucket per sync {counts}: lower rollout.weight_sync_bucket_mb"
            buckets = counts[0]
        figures["faults_injected"] += 1
        if mode == "process":
            watched.append((label, pool.submit(leftovers, procs, GRACE_S[mode]), killed_at))
        else:
            check_orphans(label, *leftovers(procs, GRACE_S[mode]))
        if resume_from is None:
            assert "resumed from" not in out
        else:
            assert f"resumed from {chain}/checkpoints/global_step_{resume_from} at step {resume_from}" in out, label
            figures["runs_resumed"] += 1
        check_left_behind(chain / "checkpoints", left_behind)

    rc, out, procs, secs = launch(overrides(model, chain, OFFLOAD), {}, log_dir)
    run_seconds.append(secs)
    assert rc == 0, out[-6000:]
    assert f"resumed from {chain}/checkpoints/global_step_{STEPS - 1} at step {STEPS - 1}" in out
    figures["runs_resumed"] += 1
    left, _ = leftovers(procs)
    assert not left, left
    assert sorted(os.listdir(chain / "checkpoints")) == [f"global_step_{STEPS - 1}", f"global_step_{STEPS}",
                                                          "latest_checkpointed_iteration.txt"]
    for label, future, killed_at in watched:
        check_orphans(label, *future.result())

    rc, out, procs, secs = reference.result()
    pool.shutdown()
    assert rc == 0, out[-6000:]
    left, _ = leftovers(procs)
    assert not left, f"the uninterrupted run left processes behind: {left}"
    run_seconds.insert(0, secs)
    # the safeguards fired and were logged with the step
    assert "FAULT reward_model_slow hit 1: stall 6 s" in out, out[-4000:]
    assert re.search(r"WARNING step 1: actor gradient circuit breaker fired: grad norm above "
                     r"actor.optim.breaker.grad_norm=1e-06 for 2 consecutive optimizer steps", out), out[-4000:]
    assert re.search(rf"WARNING step {STEPS}: alert actor/entropy=[0-9.e-]+ above 0", out)
    counts = buckets_per_sync(out)
    assert len(counts) >= STEPS and len(set(counts)) == 1, counts  # one sync per step (same plan)
    assert counts[0] == buckets, (counts, buckets)  # the plan run B's kill was aimed with
    figures["buckets_per_sync"] = counts[0]

    a = load_file(str(full / "hf_export" / "model.safetensors"))
    b = load_file(str(chain / "hf_export" / "model.safetensors"))
    figures["final_weights_equal"] = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    init = load_file(os.path.join(model[0], "model.safetensors"))
    assert any(not torch.equal(a[k], init[k]) for k in a), "training did not change the weights"
    sa, sb = run_scalars(full), run_scalars(chain)
    missing = [tag for tag in METRICS if (tag, STEPS) not in sa]
    assert not missing, f"metrics every PPO run logs are missing at step {STEPS}: {missing}"
    steps = range(1, STEPS + 1)
    for tag in EQUAL_TAGS:
        for step in steps:
            assert sa[(tag, step)] == sb[(tag, step)], (tag, step, sa[(tag, step)], sb[(tag, step)])
    # the safeguards' counters in the reference run's TensorBoard (hand values: see the module docstring)
    assert all(sa[("actor/num_breaker_events", s)] == 1.0 for s in steps)
    assert [sa[("alerts/total", s)] for s in steps] == [1.0, 2.0, 3.0]
    assert [sa[("rollout/num_fallbacks", s)] for s in steps] == [1.0, 0.0, 0.0]
    assert [sa[("rollout/num_failed_samples", s)] for s in steps] == [0.0, 0.0, 0.0]
    assert sa[("reward/model/num_fallbacks", 1)] == 8.0 and sa[("reward/num_unscorable", 1)] == 0.0
    assert all(sb[("rollout/num_fallbacks", s)] == 0.0 for s in steps)  # no request error in the chain
    assert all(sa[("actor/num_skipped_steps", s)] == 0.0 for s in steps)
    figures["runs"] = len(run_seconds)
    figures["run_seconds"] = [round(s) for s in run_seconds]
    figures["total_seconds"] = round(time.monotonic() - t_start)
    print("FAULT MATRIX " + json.dumps(figures), flush=True)
    if os.environ.get("RLHF_FAULT_FIGURES"):  # a file to write the figures to (for the README table)
        with open(os.environ["RLHF_FAULT_FIGURES"], "w") as f:
            json.dump(figures, f)
    assert figures["final_weights_equal"], "the resumed chain's weights differ from the uninterrupted run"
