"""The checks of scripts/gpu_smoke.py on what a `recipe=gpu_smoke` run left behind: its TensorBoard scalars,
its logs, its checkpoints and its exit codes.  Each check returns ``(name, ok, detail)``; nothing here starts a
run."""
from __future__ import annotations

import glob
import math
import os

#: step metrics every step writes (PPO with a critic), and those only an actor update writes
EVERY_STEP = ("critic/vf_loss", "critic/score/mean", "timing_s/gen", "timing_s/update_critic")
ACTOR_STEP = ("actor/pg_loss", "timing_s/update_actor", "timing_s/update_weights")
VAL = "val/score"


def read_scalars(run_dir: str) -> dict:
    """``{tag: {step: value}}`` of every scalar under ``run_dir``/tensorboard (all event files, in the order the
    runs wrote them: a step logged twice keeps the later run's value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    files = glob.glob(os.path.join(run_dir, "tensorboard", "**", "events.out.tfevents.*"), recursive=True)
    for f in sorted(files, key=os.path.getmtime):
        acc = EventAccumulator(f, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                out.setdefault(tag, {})[e.step] = e.value
    return out


def _finite_at(s: dict, tags, steps) -> tuple[bool, str]:
    bad = [f"{t}@{k}" for t in tags for k in steps if not math.isfinite(s.get(t, {}).get(k, math.nan))]
    return not bad, ("missing or not finite: " + ", ".join(bad)) if bad else f"{len(tags)} tags x steps {list(steps)}"


def check_run(run_dir: str, rcs: tuple[int, int], logs: tuple[str, str], val_tolerance: float) -> list:
    """The checks of a first run (steps 1-3) and its resumed second run (step 4) in ``run_dir``."""
    s = read_scalars(run_dir)
    out = [("exit_codes", rcs == (0, 0), f"first run {rcs[0]}, resumed run {rcs[1]}")]
    out.append(("step_metrics_1_3", *_finite_at(s, EVERY_STEP, (1, 2, 3))))
    out.append(("actor_metrics_2_3", *_finite_at(s, ACTOR_STEP, (2, 3))))
    # step 1 trains only the critic and syncs nothing (no actor / sync metrics at step 1); its colocated engine
    # released (lost) its weights while the trainer computed: the validation after it syncs first (ensure_resident)
    at1 = [t for t in ACTOR_STEP if 1 in s.get(t, {})]
    out.append(("critic_warmup_step_1", not at1 and 1 in s.get("critic/vf_loss", {}),
                f"actor update / weight sync metrics at step 1: {at1 or 'none'}; critic trained: "
                f"{1 in s.get('critic/vf_loss', {})}"))
    # the actor did not change at step 1, so greedy validation after it must score as before training: a
    # resumed engine whose weights nothing refilled (SGLang's memory saver) would not
    val = s.get(VAL, {})
    ok = 0 in val and 1 in val and all(math.isfinite(val[k]) for k in (0, 1)) and abs(val[1] - val[0]) <= val_tolerance
    out.append(("generation_after_warmup", ok, f"{VAL} step 0 {val.get(0)} -> step 1 {val.get(1)} (same actor; "
                                               f"tolerance {val_tolerance}); all validations: {sorted(val)}"))
    ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "checkpoints", "global_step_*")))
    out.append(("checkpoint_written", any(c in ckpts for c in ("global_step_2", "global_step_3")), f"{ckpts}"))
    resumed = [ln.strip() for ln in logs[1].splitlines() if "resumed from" in ln]
    out.append(("resumed", bool(resumed) and "resumed from" not in logs[0],
                (resumed[0][-160:] if resumed else "no 'resumed from' line in the second run's log")))
    out.append(("step_4_after_resume", *_finite_at(s, EVERY_STEP + ACTOR_STEP, (4,))))
    return out
