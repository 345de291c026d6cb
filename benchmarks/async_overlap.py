"""Benchmark: one-step off-policy overlap (trainer.one_step_off_policy, rlhf/trainer/one_step_off.py) against the
synchronous trainer on the same GRPO quickstart-sized job, the rollout engine and the trainer pinned to one core
each, so that generating the next batch while the trainer trains can save time only by the overlap.

    python benchmarks/async_overlap.py                    # 12 steps each, median over steps 3..12
    python benchmarks/async_overlap.py --steps 8 --last 3 # shorter

Job: ``python -m rlhf.main recipe=quickstart algorithm=grpo`` (the tiny model, built once for both runs, embedded arithmetic task, one SGLang
CPU engine under Ray, megatron actor, no critic / reference), ``--steps`` steps, no validation, no checkpoints,
the same seed; run once synchronously, once with ``trainer.one_step_off_policy.enable=true`` (staleness 1), one
after the other.  Pinning: a watcher pins every thread of the trainer process to core ``--trainer-core`` and every
thread of every other process the job starts (Ray, the engine's Ray worker and SGLang's scheduler) to core
``--engine-core``, re-applied every 0.2 s for threads started later; the trainer runs one torch thread
(OMP_NUM_THREADS=1).

The LAST line printed is exactly
    async: step_ratio=<async/sync> staleness_max=<n> reward_gap=<sync-async, last steps>
step_ratio: median ``timing_s/step`` of the one-step-off run over the timed steps (all but the first two: start-up)
/ the synchronous run's (with ``--pairs N``: the median of the N pairs' ratios, the pairs in alternating order); staleness_max: max ``async/staleness/max`` of the one-step-off run (1 by design);
reward_gap: mean ``critic/score/mean`` over the last ``--last`` steps, synchronous minus one-step-off (the cost of
training on one-step-old samples, noisy at this size; averaged over pairs).  The load average before each run and
after each pair is printed too.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


def pin_tree(root_pid: int, trainer_core: int, engine_core: int, stop: threading.Event) -> None:
    """Until `stop`: every thread of `root_pid` on `trainer_core`, every thread of its descendants on `engine_core`."""
    import psutil

    while not stop.is_set():
        try:
            procs = [psutil.Process(root_pid)] + psutil.Process(root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            core = trainer_core if p.pid == root_pid else engine_core
            try:
                for tid in os.listdir(f"/proc/{p.pid}/task"):
                    os.sched_setaffinity(int(tid), {core})
            except (OSError, ValueError):
                pass  # gone meanwhile
        stop.wait(0.2)


def run_job(name: str, out_dir: str, steps: int, extra: list, a) -> dict:
    """One training run; returns its TensorBoard series {tag: {step: value}}."""
    from tests.support.tracking_readers import run_series

    cmd = [sys.executable, "-m", "rlhf.main", "recipe=quickstart", "algorithm=grpo",
           f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out_dir}", "trainer.save_freq=-1",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.export_hf_at_end=false",
           "trainer.progress_bar=false", "trainer.resume_mode=disable", *a.overrides, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RAY_DEDUP_LOGS="0")
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    log = open(out_dir + ".log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stop = threading.Event()
    watcher = threading.Thread(target=pin_tree, args=(proc.pid, a.trainer_core, a.engine_core, stop), daemon=True)
    watcher.start()
    rc = proc.wait()
    stop.set()
    watcher.join()
    if rc != 0:
        print(open(out_dir + ".log").read()[-4000:])
        raise SystemExit(f"[{name}] exit {rc}")
    print(f"[{name}] {time.time() - t0:.0f} s", flush=True)
    return run_series(out_dir)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the median (start-up)")
    ap.add_argument("--last", type=int, default=4, help="steps of the reward comparison (the last ones)")
    ap.add_argument("--pairs", type=int, default=1, help="(sync, one-step-off) pairs, in alternating order; the "
                    "step ratio is the median of the pairs' ratios (load drifts between runs)")
    ap.add_argument("--trainer-core", type=int, default=0)
    ap.add_argument("--engine-core", type=int, default=1)
    ap.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="async_overlap_")
    os.makedirs(out, exist_ok=True)
    from rlhf.quickstart.model import build_quickstart_model

    model = build_quickstart_model(os.path.join(out, "tiny_model"))  # one model for all runs
    a.overrides = [f"model.path={model}", *a.overrides]
    timed, last = range(a.skip + 1, a.steps + 1), range(a.steps - a.last + 1, a.steps + 1)
    ratios, gaps, staleness = [], [], 0.0
    for pair in range(a.pairs):
        order = [("sync", []), ("one_step_off", ["trainer.one_step_off_policy.enable=true"])]
        runs = {}
        for name, extra in (order if pair % 2 == 0 else order[::-1]):
            print(f"load average before {name} (pair {pair + 1}): {os.getloadavg()}", flush=True)
            runs[name] = run_job(name, os.path.join(out, f"{name}_{pair + 1}"), a.steps, extra, a)
        print(f"load average after pair {pair + 1}: {os.getloadavg()}", flush=True)
        med = {}
        for name, series in runs.items():
            phases = {k: median([series[f"timing_s/{k}"][s] for s in timed if s in series[f"timing_s/{k}"]])
                      for k in ("step", "gen", "reward", "old_log_prob", "update_actor", "update_weights")
                      if f"timing_s/{k}" in series}
            med[name] = phases["step"]
            print(f"[{name} {pair + 1}] median seconds over steps {a.skip + 1}..{a.steps}: "
                  + " ".join(f"{k}={v:.3f}" for k, v in phases.items()), flush=True)
        reward = {n: sum(s["critic/score/mean"][k] for k in last) / len(last) for n, s in runs.items()}
        print(f"[rewards {pair + 1}] last {a.last} steps: sync={reward['sync']:.4f} "
              f"one_step_off={reward['one_step_off']:.4f}", flush=True)
        ratios.append(med["one_step_off"] / med["sync"])
        gaps.append(reward["sync"] - reward["one_step_off"])
        staleness = max(staleness, max(runs["one_step_off"]["async/staleness/max"].values()))
    print(f"pair ratios: {[round(r, 3) for r in ratios]}")
    print(f"async: step_ratio={median(ratios):.3f} staleness_max={staleness:.0f} "
          f"reward_gap={sum(gaps) / len(gaps):.4f}")


if __name__ == "__main__":
    main()
