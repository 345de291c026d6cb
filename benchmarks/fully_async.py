"""Benchmark: fully async training with token-level TIS (async_training.*, rlhf/trainer/fully_async.py;
algorithm.rollout_correction.rollout_is=token) against the synchronous trainer on the GRPO quickstart, over the same
number of samples: does training on stale, partially rolled-out samples reach the synchronous reward?

    python benchmarks/fully_async.py                      # 24 steps each, reward over the last 8
    python benchmarks/fully_async.py --steps 12 --last 4  # shorter

Job: ``python -m rlhf.main recipe=quickstart algorithm=grpo`` (the tiny model built once for both runs, the
embedded arithmetic task, one SGLang CPU engine under Ray, megatron actor), ``--steps`` steps of 16 prompts x
``rollout.n=4`` samples, no validation or checkpoints, the same seed; the engine and the trainer pinned to one core
each (benchmarks/async_overlap.py's watcher).  The fully async run: ``async_training.enable=true``,
``require_batches=4`` (4 x actor.ppo_mini_batch_size=4 = the synchronous step's 16 prompts),
``trigger_parameter_sync_step=1``, ``staleness_threshold=0.5``, ``partial_rollout=true`` (chunks of 4 tokens),
``compute_prox_log_prob=true`` (the trainer's log-probs, against which token-level TIS corrects the engine's).

The LAST line printed is exactly
    fully_async: reward_sync=<r> reward_async=<r> reward_gap=<sync-async> staleness_max=<n> partial_ratio=<mean>
          step_ratio=<async/sync>
reward_*: mean ``critic/score/mean`` over the last ``--last`` steps (averaged over ``--pairs``); staleness_max:
max ``async/staleness/max``; partial_ratio: mean ``fully_async/partial/partial_ratio`` (samples whose tokens span a
weight sync); step_ratio: median ``timing_s/step`` over steps 3.., fully async / synchronous.
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from async_overlap import median, run_job  # noqa: E402 - the same job runner and pinning

FULLY_ASYNC = ["async_training.enable=true", "async_training.require_batches=4",
               "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=0.5",
               "async_training.partial_rollout=true", "async_training.partial_rollout_chunk_tokens=4",
               "async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_is=token"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--last", type=int, default=8, help="steps of the reward comparison (the last ones)")
    ap.add_argument("--pairs", type=int, default=1, help="(sync, fully async) pairs, seeds trainer.seed=--seed, +1, ...")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trainer-core", type=int, default=0)
    ap.add_argument("--engine-core", type=int, default=1)
    ap.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for both runs (after the fully async ones)")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="fully_async_")
    os.makedirs(out, exist_ok=True)
    from rlhf.quickstart.model import build_quickstart_model

    model = build_quickstart_model(os.path.join(out, "tiny_model"))
    base, user = [f"model.path={model}"], list(a.overrides)  # the user's overrides last: they win in both runs
    last, timed = range(a.steps - a.last + 1, a.steps + 1), range(3, a.steps + 1)
    rewards, stale, partial, ratios = {"sync": [], "fully_async": []}, 0.0, [], []
    for pair in range(a.pairs):
        a.overrides = [*base, f"trainer.seed={a.seed + pair}"]
        runs = {name: run_job(name, os.path.join(out, f"{name}_{pair + 1}"), a.steps, [*extra, *user], a)
                for name, extra in (("sync", []), ("fully_async", FULLY_ASYNC))}
        for name, s in runs.items():
            rewards[name].append(sum(s["critic/score/mean"][k] for k in last) / len(last))
            print(f"[{name} {pair + 1}] critic/score/mean by step: "
                  + " ".join(f"{s['critic/score/mean'][k]:.3f}" for k in sorted(s["critic/score/mean"])), flush=True)
        fa = runs["fully_async"]
        stale = max(stale, max(fa["async/staleness/max"].values()))
        partial += list(fa["fully_async/partial/partial_ratio"].values())
        ratios.append(median([runs["fully_async"]["timing_s/step"][k] for k in timed])
                      / median([runs["sync"]["timing_s/step"][k] for k in timed]))
    r_sync, r_async = (sum(v) / len(v) for v in (rewards["sync"], rewards["fully_async"]))
    print(f"fully_async: reward_sync={r_sync:.4f} reward_async={r_async:.4f} reward_gap={r_sync - r_async:.4f} "
          f"staleness_max={stale:.0f} partial_ratio={sum(partial) / len(partial):.3f} "
          f"step_ratio={median(ratios):.3f}")


if __name__ == "__main__":
    main()
