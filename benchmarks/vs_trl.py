"""Benchmark: our GRPO step against Hugging Face TRL's GRPOTrainer on the same CPU, model, data and settings.

    pip install -e '.[bench]'                 # TRL, pinned (trl==1.16.0); best in its own venv
    python benchmarks/vs_trl.py               # both sizes, 2 alternating rounds per side
    python benchmarks/vs_trl.py --size tiny --rounds 1 --steps 4     # quicker
    python benchmarks/vs_trl.py --size tiny --rounds 1 --breakdown   # + the processes at each run's peak PSS
    python benchmarks/vs_trl.py --curves --seeds 0 1 2 --steps 30    # reward per step of both sides

--curves: the tiny size, one run per side and seed s (alternating): ours with data.seed=s trainer.seed=s, TRL with
GRPOConfig(seed=s) reading the prompts in our loader's order for data.seed=s (checked token by token against our
trainer's dataset); per step the mean reward of the round (ours: critic/score/mean; TRL: its logged `reward`, one
per 4 optimizer steps = one generation round).  Prints the per-step means over seeds, then
    vs_trl_curves: auc=<ours/trl> last5=<ours>/<trl> diff=<d>+-<se> ours_higher=<j>/K steps=N seeds=K
(auc: mean reward over all steps and seeds; last5: over the last 5 steps; diff: ours minus TRL's mean reward of a
seed, mean over the K seeds +- its standard error; ours_higher: seeds where ours is higher).
Every child process imports rlhf from the checkout this script sits in (PYTHONPATH), whatever the interpreter.

Sizes (`--size tiny|40m|both`):
  tiny -- the quickstart model (tiny://quickstart, built once, SFT-warmed on the arithmetic task), the
          `grpo_tiny_cpu` settings: 16 prompts x 4 responses, 16 new tokens;
  40m  -- a random Llama (hidden 512, 8 heads / 4 KV heads, FFN 1408, 4 layers, the quickstart tokenizer's
          vocabulary padded to 32000: ~40 M parameters), 64 new tokens.
Both sides: the same HF directory and parquet of arithmetic prompts (verl layout, chat prompts), the same
rule reward (rlhf.rewards' arithmetic scorer), n=4, temperature 1, lr 2e-4, one epoch, 4 mini batches of 16
sequences per generation round (ours: ppo_mini_batch_size=4 prompts; TRL: per_device_train_batch_size=16,
steps_per_generation=4), the round's rows shuffled before they are cut into those mini batches (TRL always; ours
actor.shuffle=true, `--ours-no-shuffle` for verl's default), group-normalised advantages, token-mean loss (TRL
loss_type="dapo"), no KL (TRL beta=0), clip 0.2.  Each run is its own process; ours and TRL's alternate,
`--rounds` times.  Diagnostics of the curves: `--sides`, `--trl-no-shuffle`, `--trl-loss-type bnpo`.

What is measured (medians over steps after `--warmup`):
  step    -- one generation round and its 4 optimizer steps (ours: timing_s/step; TRL: the sum of the 4
             optimizer steps that share one generation, from its callbacks);
  gen     -- ours timing_s/gen; TRL: time in `model.generate`;
  logprob -- ours timing_s/old_log_prob; TRL: the no-grad `_get_per_token_logps_and_entropies` calls
             (old log-probs; TRL computes them because steps_per_generation > gradient accumulation);
  update  -- ours timing_s/update_actor; TRL: step - gen - logprob;
  rss     -- peak over the run of the summed proportional set size (PSS, shared pages split) of the
             process and all its descendants (trainer ranks, the engine's processes, Ray), sampled at 2 Hz;
  first_step_s -- process start to the end of step 1 (the model already built).
The LAST line printed is exactly
    vs_trl: step=<ours/trl> gen=<..> update=<..> logprob=<..> rss=<..> first_step_s=<ours>/<trl>
for the last size run (one such line per size is printed, prefixed by the size).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
# Every process started here (our trainer, its engine and Ray workers, the TRL worker) imports rlhf from the checkout
# this script sits in, not from whatever an editable install in the running interpreter's venv points at.
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(
    p for p in [ROOT, *os.environ.get("PYTHONPATH", "").split(os.pathsep)] if p))}

SIZES = {"tiny": dict(response_length=16), "40m": dict(response_length=64)}
PROMPTS, N, LR, MINI = 16, 4, 2e-4, 4
SEED = 1  # our data.seed / trainer.seed default


def prepare(size: str, workdir: str) -> tuple:
    """(model_dir, train_parquet) for `size`, built once under `workdir`."""
    from rlhf.config import compose_config
    from rlhf.quickstart.arithmetic import quickstart_task_kwargs, write_arithmetic_parquet
    from rlhf.quickstart.model import resolve_model_path

    cfg = compose_config(["recipe=grpo_tiny_cpu", f"trainer.default_local_dir={workdir}/quickstart"])
    tiny = resolve_model_path("tiny://quickstart", os.path.join(workdir, "tiny_model"),
                              warmup_steps=cfg.model.warmup_steps, warmup_lr=cfg.model.warmup_lr,
                              max_operand=cfg.data.embedded_max_operand)
    data = write_arithmetic_parquet(os.path.join(workdir, "data"), 512, 64, seed=cfg.data.seed,
                                    **quickstart_task_kwargs(cfg.data.embedded_max_operand))["train"]
    if size == "tiny":
        return tiny, str(data)
    out = os.path.join(workdir, "llama40m")
    if not os.path.isfile(os.path.join(out, "config.json")):
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(tiny)
        conf = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
        LlamaForCausalLM(conf).save_pretrained(out)
        tok.save_pretrained(out)
    return out, str(data)


class TreeMemory:
    """Peak summed PSS of a process and its descendants, sampled in a thread; `at_peak` holds the processes of
    the peak sample as (pss bytes, uss bytes, pid, command line)."""

    def __init__(self, pid: int, period: float = 0.5):
        import psutil

        self.root, self.peak, self._stop, self.at_peak = psutil.Process(pid), 0, threading.Event(), []
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period):
        import psutil

        while not self._stop.is_set():
            total, rows = 0, []
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    info = p.memory_full_info()
                    rows.append((info.pss, info.uss, p.pid, " ".join(p.cmdline()) or p.name()))
                    total += info.pss
                except psutil.Error:
                    pass
            if total > self.peak:
                self.peak, self.at_peak = total, rows
            self._stop.wait(period)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30


def print_breakdown(rows: list, who: str) -> None:
    """The processes of a peak-PSS sample, largest first: PSS and USS in MiB and the command line."""
    print(f"[memory] {who}: peak PSS {sum(r[0] for r in rows) / 2**30:.2f} GiB over {len(rows)} processes "
          f"(PSS MiB, USS MiB, pid, command)")
    for pss, uss, pid, cmd in sorted(rows, reverse=True):
        print(f"[memory]   {pss / 2**20:8.1f} {uss / 2**20:8.1f} {pid:>7} {cmd[:150]}")


BREAKDOWN = []  # (who, rows at peak) of every run, printed with --breakdown


def run_measured(cmd: list, who: str) -> float:
    """Run `cmd` to completion; its process tree's peak PSS in GiB (the processes at the peak appended to
    BREAKDOWN).  Raises RuntimeError with the log's tail when it fails."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mem = TreeMemory(proc.pid)
    log, _ = proc.communicate()
    rss = mem.stop()
    BREAKDOWN.append((who, mem.at_peak))
    if proc.returncode:
        with open(os.path.join(tempfile.gettempdir(), f"vs_trl_{who.lower()}_failed.log"), "w") as f:
            f.write(log)
        raise RuntimeError(f"{who} run failed (exit {proc.returncode}; whole log in {f.name}):\n{log[-4000:]}")
    return rss


def run_ours(model: str, data: str, steps: int, response_length: int, out: str, seed: int = SEED,
             shuffle: bool = True) -> dict:
    """Our trainer; its TensorBoard scalars per step.  `seed`: data.seed (prompt order) and trainer.seed
    (sampling seeds, init).  `shuffle`: actor.shuffle -- TRL shuffles a round's rows before it cuts them into
    mini batches, so the same mini batches are ours with actor.shuffle=true (verl's default is false)."""
    cmd = [sys.executable, "-m", "rlhf.main", "recipe=grpo_tiny_cpu", f"model.path={model}",
           f"data.train_files={data}", f"data.val_files={data}", f"data.max_response_length={response_length}",
           f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", f"actor.optim.lr={LR}",
           f"actor.ppo_mini_batch_size={MINI}", "actor.ppo_micro_batch_size_per_gpu=16",
           f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
           "trainer.val_before_train=false", f"trainer.default_local_dir={out}", "trainer.logger=[tensorboard]",
           "data.shuffle=true", f"data.seed={seed}", f"trainer.seed={seed}", f"actor.shuffle={str(shuffle).lower()}"]
    start, rss = time.time(), run_measured(cmd, "our")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if "tfevents" in f]
    acc = EventAccumulator(os.path.dirname(tb[0]), size_guidance={"scalars": 0})
    acc.Reload()

    def series(tag):
        return [e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.step)]

    step_events = sorted(acc.Scalars("timing_s/step"), key=lambda e: e.step)
    return {"step": series("timing_s/step"), "gen": series("timing_s/gen"),
            "logprob": series("timing_s/old_log_prob"), "update": series("timing_s/update_actor"),
            "rss_gib": rss, "first_step_s": step_events[0].wall_time - start,
            "score": series("critic/score/mean")}


def run_trl(model: str, data: str, steps: int, response_length: int, out: str, seed: int = SEED,
            loss_type: str = "dapo", no_shuffle: bool = False) -> dict:
    """TRL's GRPOTrainer in its own process (:func:`trl_worker`); its timings, rewards and prompts per round.
    ``loss_type``, ``no_shuffle``: see ``--trl-loss-type`` and ``--trl-no-shuffle``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", "--model", model, "--data", data,
           "--steps", str(steps), "--response-length", str(response_length), "--out", out, "--seed", str(seed),
           "--trl-loss-type", loss_type, *(["--trl-no-shuffle"] if no_shuffle else [])]
    start, rss = time.time(), run_measured(cmd, "TRL")
    with open(os.path.join(out, "trl_timings.json")) as f:
        r = json.load(f)
    r.update(rss_gib=rss, first_step_s=r["first_round_end"] - start)
    return r


def trl_worker(a) -> None:
    """Inside the TRL process: GRPOTrainer with timers around generate and the old log-prob forward."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.rewards import ARITHMETIC_DATA_SOURCE, call_reward_fn, get_reward_fn

    import rlhf
    from rlhf.data.loader import StatefulPromptLoader

    if not os.path.abspath(rlhf.__file__).startswith(ROOT + os.sep):
        raise RuntimeError(f"the TRL worker imported rlhf from {rlhf.__file__}, not from {ROOT}")
    scorer = get_reward_fn(ARITHMETIC_DATA_SOURCE)
    round_rewards = []  # mean reward of each generation round, as scored here

    def reward(prompts, completions, ground_truth, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [call_reward_fn(scorer, ARITHMETIC_DATA_SOURCE, t, g) for t, g in zip(texts, ground_truth)]
        round_rewards.append(statistics.fmean(out))
        return out

    # The prompt order our trainer visits with data.seed=a.seed (its loader's first-epoch permutation), read by
    # TRL unshuffled: both sides see the same 16 prompts at each step.
    ds = load_dataset("parquet", data_files=a.data, split="train")
    order = StatefulPromptLoader(range(len(ds)), PROMPTS, shuffle=True, seed=a.seed).epoch_order(0)
    ds = ds.select([int(i) for i in order[:PROMPTS * a.steps]])
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    timers = {"gen": 0.0, "logprob": 0.0}

    def timed(fn, key, when=lambda: True):
        def inner(*args, **kw):
            if not when():
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                timers[key] += time.perf_counter() - t0
        return inner

    model.generate = timed(model.generate, "gen")
    if a.trl_no_shuffle:  # our (verl's) mini batches: the round's consecutive prompt groups
        import trl.trainer.grpo_trainer as grpo_module

        grpo_module.shuffle_sequence_dict = lambda batch: batch
    args = GRPOConfig(output_dir=a.out, per_device_train_batch_size=PROMPTS * N // MINI, num_generations=N,
                      steps_per_generation=MINI, max_completion_length=a.response_length, learning_rate=LR,
                      lr_scheduler_type="constant", temperature=1.0, beta=0.0, epsilon=0.2,
                      loss_type=a.trl_loss_type,
                      num_iterations=1, max_steps=a.steps * MINI, logging_steps=MINI, save_strategy="no",
                      report_to=[], use_cpu=True, shuffle_dataset=False, seed=a.seed, bf16=False, fp16=False,
                      max_grad_norm=1.0, weight_decay=0.0, warmup_steps=0, dataloader_num_workers=0)
    rounds = []

    class Timing(TrainerCallback):
        def __init__(self):
            self.t0, self.k = None, 0

        def on_step_begin(self, args, state, control, **kw):
            if self.k % MINI == 0:
                self.t0 = time.perf_counter()
                timers.update(gen=0.0, logprob=0.0)

        def on_step_end(self, args, state, control, **kw):
            self.k += 1
            if self.k % MINI == 0:
                step = time.perf_counter() - self.t0
                rounds.append(dict(step=step, gen=timers["gen"], logprob=timers["logprob"], end=time.time()))

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Timing()])
    prompt_ids = []  # token ids of each round's prompts (one per group), as TRL tokenised them

    def record_prompts(fn):
        def inner(prompts, *args, **kw):
            out = fn(prompts, *args, **kw)
            prompt_ids.append([list(map(int, ids)) for ids in out[0][::N]])
            return out
        return inner

    trainer._tokenize_prompts = record_prompts(trainer._tokenize_prompts)
    trainer._get_per_token_logps_and_entropies = timed(trainer._get_per_token_logps_and_entropies, "logprob",
                                                       when=lambda: not torch.is_grad_enabled())
    trainer.train()
    res = {k: [r[k] for r in rounds] for k in ("step", "gen", "logprob")}
    res["update"] = [r["step"] - r["gen"] - r["logprob"] for r in rounds]
    res["first_round_end"] = rounds[0]["end"]
    res["score"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    res.update(round_rewards=round_rewards, prompt_ids=prompt_ids)
    with open(os.path.join(a.out, "trl_timings.json"), "w") as f:
        json.dump(res, f)


def our_prompt_ids(model: str, data: str, steps: int, seed: int) -> list:
    """Token ids of the prompts our trainer generates for at steps 1..`steps` with data.seed=`seed`: its dataset
    built the way the trainer builds it (same function, same config), in its loader's order."""
    from transformers import AutoTokenizer

    from rlhf.config import compose_config
    from rlhf.data.build import build_rl_dataset, needs_ground_truth
    from rlhf.data.loader import StatefulPromptLoader

    cfg = compose_config(["recipe=grpo_tiny_cpu", f"model.path={model}", f"data.train_files={data}",
                          f"data.train_batch_size={PROMPTS}", "data.shuffle=true", f"data.seed={seed}"])
    train = build_rl_dataset(cfg.data, "train", data, AutoTokenizer.from_pretrained(model), None,
                             require_ground_truth=needs_ground_truth(cfg.reward))
    loader = StatefulPromptLoader(train, PROMPTS, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    return [[train[i]["input_ids"] for i in loader.batch_indices(0, k)] for k in range(steps)]


def curves(a) -> None:
    """Reward per step of both sides on the quickstart task, one run per side and seed (alternating)."""
    model, data = prepare("tiny", a.workdir)
    R = SIZES["tiny"]["response_length"]
    score = {"ours": [], "trl": []}
    for k, seed in enumerate(a.seeds):
        for side in [x for x in (("ours", "trl") if k % 2 == 0 else ("trl", "ours")) if x in a.sides]:
            out = tempfile.mkdtemp(prefix=f"curves_s{seed}_{side}_", dir=a.workdir)
            res = (run_ours(model, data, a.steps, R, out, seed, not a.ours_no_shuffle) if side == "ours" else
                   run_trl(model, data, a.steps, R, out, seed, a.trl_loss_type, a.trl_no_shuffle))
            if len(res["score"]) != a.steps:
                raise RuntimeError(f"{side} seed {seed}: {len(res['score'])} rewards logged for {a.steps} steps")
            if side == "trl":
                theirs, ours = res["prompt_ids"], our_prompt_ids(model, data, a.steps, seed)
                if theirs != ours:
                    bad = next(i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y)
                    raise RuntimeError(f"seed {seed}: TRL's prompts at step {bad + 1} differ from ours:\n"
                                       f"{theirs[bad][:2]}\n{ours[bad][:2]}")
                if max(abs(x - y) for x, y in zip(res["score"], res["round_rewards"])) > 1e-6:
                    raise RuntimeError(f"TRL's logged reward {res['score']} is not the scorer's {res['round_rewards']}")
            score[side].append(res["score"])
            print(f"[curves] seed {seed} {side}: {' '.join(f'{x:.3f}' for x in res['score'])}", flush=True)
    if len(a.sides) < 2:  # one side only: its curves above, to be paired with another run's by seed
        return
    mean = {side: [statistics.fmean(run[i] for run in runs) for i in range(a.steps)] for side, runs in score.items()}
    print("| step | ours | TRL |\n| --- | --- | --- |")
    for i in range(a.steps):
        print(f"| {i + 1} | {mean['ours'][i]:.3f} | {mean['trl'][i]:.3f} |")
    auc = {side: statistics.fmean(m) for side, m in mean.items()}
    per_seed = " ".join(f"{seed}:{statistics.fmean(o):.3f}/{statistics.fmean(t):.3f}"
                        for seed, o, t in zip(a.seeds, score["ours"], score["trl"]))
    print(f"[curves] mean reward per seed (ours/trl) {per_seed}; all steps {auc['ours']:.3f}/{auc['trl']:.3f}")
    last = min(5, a.steps)
    # paired over seeds: each seed's mean reward over the steps, ours minus TRL's (mean +- standard error)
    diffs = [statistics.fmean(o) - statistics.fmean(t) for o, t in zip(score["ours"], score["trl"])]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    print(f"vs_trl_curves: auc={auc['ours'] / auc['trl']:.2f} last5={statistics.fmean(mean['ours'][-last:]):.3f}/"
          f"{statistics.fmean(mean['trl'][-last:]):.3f} diff={statistics.fmean(diffs):+.3f}+-{se:.3f} "
          f"ours_higher={sum(d > 0 for d in diffs)}/{len(diffs)} steps={a.steps} seeds={len(a.seeds)}")


def med(xs, warmup):
    xs = xs[warmup:] or xs
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["tiny", "40m", "both"], default="both")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs per side")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "vs_trl"))
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model"), ap.add_argument("--data"), ap.add_argument("--out")
    ap.add_argument("--response-length", type=int, default=16)
    ap.add_argument("--seed", type=int, default=SEED, help=argparse.SUPPRESS)
    ap.add_argument("--breakdown", action="store_true", help="print the processes at each run's peak PSS")
    ap.add_argument("--curves", action="store_true",
                    help="reward per step of both sides on the quickstart task (tiny size), one run per seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--curves: data and sampling seeds")
    ap.add_argument("--sides", nargs="+", choices=["ours", "trl"], default=["ours", "trl"],
                    help="--curves: run only these sides (one side: its curves only, no comparison)")
    ap.add_argument("--ours-no-shuffle", action="store_true",
                    help="ours with actor.shuffle=false (verl's default: a mini batch is whole prompt groups)")
    ap.add_argument("--trl-loss-type", default="dapo", choices=["dapo", "bnpo"],
                    help="TRL's loss normalisation: dapo (default: the round's tokens / mini batches) or bnpo (each "
                         "mini batch's own tokens, as our token-mean)")
    ap.add_argument("--trl-no-shuffle", action="store_true",
                    help="diagnostic: TRL cuts the round into mini batches of consecutive prompt groups, as ours "
                         "(verl's), instead of shuffling its rows first")
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("TRL is not installed: pip install -e '.[bench]' (trl==1.16.0)")
    if a.curves:
        return curves(a)
    lines = []
    for size in (["tiny", "40m"] if a.size == "both" else [a.size]):
        model, data = prepare(size, a.workdir)
        R = SIZES[size]["response_length"]
        runs = {"ours": [], "trl": []}
        for r in range(a.rounds):
            for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
                out = tempfile.mkdtemp(prefix=f"{size}_{side}_", dir=a.workdir)
                fn = run_ours if side == "ours" else run_trl
                res = fn(model, data, a.steps, R, out)
                runs[side].append(res)
                print(f"[{size}] {side} run {r}: step {med(res['step'], a.warmup):.3f} s gen "
                      f"{med(res['gen'], a.warmup):.3f} logprob {med(res['logprob'], a.warmup):.3f} update "
                      f"{med(res['update'], a.warmup):.3f} rss {res['rss_gib']:.2f} GiB first_step "
                      f"{res['first_step_s']:.1f} s score {[round(s, 2) for s in res['score']]}", flush=True)
        m = {side: {k: statistics.median(med(x[k], a.warmup) for x in rs) for k in ("step", "gen", "logprob", "update")}
             for side, rs in runs.items()}
        for side, rs in runs.items():
            m[side]["rss"] = statistics.median(x["rss_gib"] for x in rs)
            m[side]["first"] = statistics.median(x["first_step_s"] for x in rs)
        o, t = m["ours"], m["trl"]
        line = (f"vs_trl: step={o['step'] / t['step']:.2f} gen={o['gen'] / t['gen']:.2f} "
                f"update={o['update'] / t['update']:.2f} logprob={o['logprob'] / t['logprob']:.2f} "
                f"rss={o['rss'] / t['rss']:.2f} first_step_s={o['first']:.1f}/{t['first']:.1f}")
        print(f"[{size}] ours {o}\n[{size}] trl  {t}\n[{size}] {line}", flush=True)
        lines.append(line)
    if a.breakdown:
        for who, rows in BREAKDOWN:
            print_breakdown(rows, who)
    print(lines[-1])


if __name__ == "__main__":
    main()
