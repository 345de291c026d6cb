"""Paired A/B of two rollout-engine settings: two engines (Ray actors, as the trainer starts them) side by side,
called in alternating order round after round, so both see the same machine load; per call the wall time of
one generation round and of a step's engine-control calls (release, resume weights, weight-update session,
resume KV cache).

    python benchmarks/engine_ab.py --env-b OMP_NUM_THREADS=2                   # engine threads 1 vs 2
    python benchmarks/engine_ab.py --kw-a skip_tokenizer_init=false            # SGLang's text mode vs ours
    python benchmarks/engine_ab.py --size 40m --rounds 8 --env-b OMP_NUM_THREADS=2

Sizes: ``tiny`` (the quickstart model, 16 prompts x 4 responses x 16 tokens, grpo_tiny_cpu) or ``40m``
(benchmarks/vs_trl.py's Llama, 64 new tokens).  ``--env-a/--env-b KEY=VALUE`` go into that engine's process
environment (after the CPU settings of rlhf.rollout.sglang_cpu), ``--kw-a/--kw-b KEY=JSON`` into its
``sglang.Engine`` arguments.  Last line:
``engine_ab: gen=<b/a> control=<b/a> gen_s=<a>/<b> control_s=<a>/<b>`` (medians of the per-round ratios and of
the times, after one warm-up round).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pairs(items):
    """``["K=V", ...]`` -> dict (values JSON-decoded where they parse)."""
    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def start(model: str, context: int, kv_tokens: int, env: dict, kw: dict):
    from rlhf.rollout.engine_args import engine_env, engine_kwargs
    from rlhf.rollout.manager import RolloutManager

    cfg = dict(model_path=model, tp_size=1, dtype="float32", context_length=context, max_total_tokens=kv_tokens,
               device="cpu", engine_overrides=kw)
    full_env = {**engine_env(engine_kwargs(**{k: v for k, v in cfg.items() if k != "engine_overrides"}, **kw)),
                **{k: str(v) for k, v in env.items()}}
    return RolloutManager(1, cfg, actor_options={"runtime_env": {"env_vars": full_env}}, start=False)


def one_round(m, prompts, sampling) -> tuple:
    t0 = time.perf_counter()
    m.generate(prompts, sampling)
    gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    m.release_memory_occupation()
    token = m.begin_sync()
    m.resume_memory_occupation(["weights"])
    m.begin_weight_update()
    m.end_weight_update()
    m.end_sync(token)
    m.resume_memory_occupation(["kv_cache"])
    return gen, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["tiny", "40m"], default="tiny")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--env-a", nargs="*"), ap.add_argument("--env-b", nargs="*")
    ap.add_argument("--kw-a", nargs="*"), ap.add_argument("--kw-b", nargs="*")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "vs_trl"))
    a = ap.parse_args()
    import ray

    from rlhf.rollout.sampling import SamplingConfig
    from vs_trl import N, PROMPTS, SIZES, prepare

    model, _ = prepare(a.size, a.workdir)
    length = SIZES[a.size]["response_length"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sides = {"a": start(model, 64 + length + 8, PROMPTS * N * (64 + length + 8), pairs(a.env_a), pairs(a.kw_a)),
             "b": start(model, 64 + length + 8, PROMPTS * N * (64 + length + 8), pairs(a.env_b), pairs(a.kw_b))}
    for m in sides.values():
        m.launch()
    for m in sides.values():
        m.start()
    prompts = [[1 + (i * 7 + j) % 50 for j in range(40)] for i in range(PROMPTS)]
    sampling = SamplingConfig(n=N, temperature=1.0, max_new_tokens=length, seed=0)
    times = {"a": [], "b": []}
    try:
        for r in range(a.rounds + 1):
            for side in ("ab" if r % 2 == 0 else "ba"):
                g, c = one_round(sides[side], prompts, sampling)
                if r:  # round 0 warms both up
                    times[side].append((g, c))
            if r:
                print(f"round {r}: gen {times['a'][-1][0]:.3f}/{times['b'][-1][0]:.3f} s control "
                      f"{times['a'][-1][1]:.3f}/{times['b'][-1][1]:.3f} s load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for m in sides.values():
            m.shutdown()
    ratio = [statistics.median(tb[k] / ta[k] for ta, tb in zip(times["a"], times["b"])) for k in (0, 1)]
    med = {s: [statistics.median(t[k] for t in times[s]) for k in (0, 1)] for s in times}
    print(f"engine_ab: gen={ratio[0]:.2f} control={ratio[1]:.2f} gen_s={med['a'][0]:.3f}/{med['b'][0]:.3f} "
          f"control_s={med['a'][1]:.3f}/{med['b'][1]:.3f}")


if __name__ == "__main__":
    main()
