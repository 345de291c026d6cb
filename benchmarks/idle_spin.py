"""Generation-round time and trainer-side compute time next to an idle SGLang engine, with the scheduler's
``sleep_on_idle`` on (our default, rlhf/rollout/engine_args.py) and off, alternating engine starts.

One engine on the quickstart model (grpo_tiny_cpu sizes: 16 prompts x 4 responses, 16 new tokens); the
"update" is a fixed amount of fp32 matmul + backward in this process, timed while the engine sits idle,
as the trainer's update does between rollouts.  Last line:
``idle_spin: gen=<sleep/spin> update=<sleep/spin> gen_s=<sleep>/<spin> update_s=<sleep>/<spin>``.

    python benchmarks/idle_spin.py [--pairs 2] [--dtype float32]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def update_work(steps: int = 30) -> float:
    torch.manual_seed(0)
    w = torch.randn(512, 512, requires_grad=True)
    x = torch.randn(256, 512)
    t0 = time.perf_counter()
    for _ in range(steps):
        (x @ w).tanh().sum().backward()
    return time.perf_counter() - t0


def measure(model_path: str, sleep: bool, dtype: str, rounds: int) -> tuple:
    from rlhf.rollout.engine_args import batch_kv_tokens
    from rlhf.rollout.manager import RolloutManager
    from rlhf.rollout.sampling import SamplingConfig

    m = RolloutManager(1, dict(model_path=model_path, tp_size=1, dtype=dtype, context_length=88,
                               max_total_tokens=batch_kv_tokens(16, 4, 64, 16), sleep_on_idle=sleep))
    try:
        prompts = [[1 + (i * 7 + j) % 50 for j in range(20)] for i in range(16)]
        sp = SamplingConfig(n=4, temperature=1.0, max_new_tokens=16)
        gen, upd = [], []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            m.generate(prompts, sp)
            g = time.perf_counter() - t0
            time.sleep(0.5)  # the engine goes idle
            u = update_work()
            if r:  # round 0 is warm-up
                gen.append(g), upd.append(u)
        return statistics.median(gen), statistics.median(upd)
    finally:
        m.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workdir", default="/tmp/idle_spin")
    a = ap.parse_args()
    import ray

    from rlhf.quickstart.model import build_quickstart_model

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    path = str(build_quickstart_model(os.path.join(a.workdir, "tiny_model")))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    res = {True: [], False: []}
    for p in range(a.pairs):
        for sleep in ((True, False) if p % 2 == 0 else (False, True)):  # alternate the order
            g, u = measure(path, sleep, a.dtype, a.rounds)
            res[sleep].append((g, u))
            print(f"pair {p} sleep_on_idle={sleep}: gen {g:.3f} s update {u:.3f} s load {os.getloadavg()[0]:.1f}",
                  flush=True)
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in res.items()}
    s, n = med[True], med[False]
    print(f"idle_spin: gen={s[0] / n[0]:.2f} update={s[1] / n[1]:.2f} gen_s={s[0]:.3f}/{n[0]:.3f} "
          f"update_s={s[1]:.3f}/{n[1]:.3f}")


if __name__ == "__main__":
    main()
