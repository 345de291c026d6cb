"""Benchmark: rollout routing replay (R3) against no replay on the tiny Qwen3-MoE (recipe moe_r3_tiny_cpu), side by
side per step: ``moe/routing_agreement`` (the fraction of (token, MoE layer) pairs whose trainer top-k equals the
engine's) and the trainer-engine log-prob gap ``actor/rollout_log_prob_diff`` (mean |old_log_probs -
rollout_log_probs| over response tokens; also ``training/rollout_probs_diff_max``).

    python benchmarks/moe_r3.py                          # 5 steps each
    python benchmarks/moe_r3.py --steps 5 rollout.dtype=float32    # extra overrides for both runs (the recipe: bf16)

Both runs: ``python -m rlhf.main recipe=moe_r3_tiny_cpu`` with the same seed and model (tiny://quickstart-moe, built
once), the engines returning their routing (``rollout.enable_rollout_routing_replay=true``); "R3" replays it in the
actor's forwards (``actor.router_replay.mode=R3``), "none" does not (``mode=disabled``: the routing serves the
metric only).  The LAST line printed is exactly
    moe_r3: agreement_min R3=<x> none=<y> gap_mean R3=<a> none=<b>
(min over steps of moe/routing_agreement; mean over steps of actor/rollout_log_prob_diff).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

TAGS = ("moe/routing_agreement", "actor/rollout_log_prob_diff", "training/rollout_probs_diff_max")


def run_job(name: str, out_dir: str, steps: int, extra: list, overrides: list) -> dict:
    """One training run; returns its TensorBoard series {tag: {step: value}}."""
    from tests.support.tracking_readers import run_series

    cmd = [sys.executable, "-m", "rlhf.main", "recipe=moe_r3_tiny_cpu", f"trainer.total_training_steps={steps}",
           f"trainer.default_local_dir={out_dir}", "trainer.export_hf_at_end=false", "trainer.progress_bar=false",
           "trainer.resume_mode=disable", *overrides, *extra]
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    with open(out_dir + ".log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        print(open(out_dir + ".log").read()[-4000:])
        raise SystemExit(f"[{name}] exit {rc}")
    print(f"[{name}] {time.time() - t0:.0f} s", flush=True)
    return run_series(out_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="moe_r3_")
    os.makedirs(out, exist_ok=True)
    from rlhf.quickstart.model import build_quickstart_model

    model = build_quickstart_model(os.path.join(out, "tiny_model"), kind="qwen3_moe")  # one model for both runs
    overrides = [f"model.path={model}", *a.overrides]
    modes = (("R3", ["actor.router_replay.mode=R3"]), ("none", ["actor.router_replay.mode=disabled"]))
    runs = {name: run_job(name, os.path.join(out, name), a.steps, extra, overrides) for name, extra in modes}
    print(f"{'step':>4} | {'agreement R3':>12} {'none':>8} | {'log-prob gap R3':>15} {'none':>10} | "
          f"{'max prob diff R3':>16} {'none':>10}")
    for step in range(1, a.steps + 1):
        v = [runs[n].get(t, {}).get(step, float("nan")) for t in TAGS for n in ("R3", "none")]
        print(f"{step:>4} | {v[0]:>12.6f} {v[1]:>8.6f} | {v[2]:>15.3e} {v[3]:>10.3e} | {v[4]:>16.3e} {v[5]:>10.3e}")
    agree = {n: min(runs[n]["moe/routing_agreement"].values()) for n in runs}
    gap = {n: sum(runs[n]["actor/rollout_log_prob_diff"].values()) / len(runs[n]["actor/rollout_log_prob_diff"])
           for n in runs}
    print(f"moe_r3: agreement_min R3={agree['R3']:.6f} none={agree['none']:.6f} "
          f"gap_mean R3={gap['R3']:.3e} none={gap['none']:.3e}", flush=True)


if __name__ == "__main__":
    main()
