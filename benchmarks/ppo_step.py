"""Benchmark: one PPO step of the trainer (megatron TP2 on CPU + one SGLang engine), each phase against
the plain transformers/torch code a user would write instead, on the same model, batch and lengths.

    python benchmarks/ppo_step.py                       # launches torchrun with 2 processes itself
    python benchmarks/ppo_step.py --layers 2 --repeats 3 --response-length 32     # smaller/faster
    python benchmarks/ppo_step.py --py-spy DIR          # py-spy profiles of the timed steps (raw stacks;
                                                        # no baselines then), see benchmarks/pyspy_summary.py

Model ("benchmark model"): a random Llama, hidden 512, 8 heads / 4 KV heads, FFN 1408, 4 layers, vocab
32000 (untied, fp32) = 44.6 M parameters, 178 MB: large enough that matmuls, not Python, dominate a
phase on a 2-core CPU (the 125 k-parameter quickstart model measures only overhead), small enough that
warm-up + 5 timed steps + the baselines finish in a few minutes.  Tokenizer: the quickstart's tiny BPE
(GSM8K prompts are ~100-300 tokens with it).  A random model never emits EOS, so every response has
exactly --response-length tokens in both the engine and HF `generate` (checked and printed).

Step: `PPOTrainer.train_step` of the real trainer (recipe gsm8k_ppo_tiny_cpu, algorithm=grpo, no critic,
no reference; real GSM8K prompts and reward), --prompts prompts x --n responses, greedy (temperature 0),
one optimizer step per step (ppo_mini_batch_size = --prompts), micro batches of --micro sequences.
Phases are the trainer's own timers (timing_s/gen, timing_s/reward, timing_s/old_log_prob, timing_s/update_actor,
timing_s/update_weights, timing_s/step); overhead = step - those five (advantages, batch building, metrics).
(Before issue 42 timing_s/gen included the reward and the sync was timing_s/sync_weights.)

Baselines (rank 0, torch threads = --hf-threads, default 2 = the cores the two trainer ranks use; rank 1
waits; the engine stays up, as during the step), run right after each trainer step on that step's prompts
and batch, so each pair is measured under the same machine load:
  gen     -- `model.generate(..., do_sample=False)` on the same prompts (n copies each, left-padded);
  logprob -- `model(input_ids, attention_mask, position_ids).logits` -> log_softmax -> gather, no grad;
  update  -- the same micro batches: forward, PPO clipped loss (token-mean, dual clip), backward;
             clip_grad_norm_ and one `torch.optim.AdamW` step (state kept across steps);
  copy    -- `dst.copy_(src)` of a flat buffer of the bytes the weight bridge sent (one thread).
Correctness probes on step 1 (initial weights on both sides): engine vs HF greedy tokens, trainer vs HF
old log-probs.  --dynamic-bsz TOKENS runs the actor with dynamic batching (docs/dynamic_batching.md).

The LAST line printed is exactly
    ppo_step: gen_vs_hf=<..> logprob_vs_hf=<..> update_vs_hf=<..> sync_vs_copy=<..> overhead_frac=<..>
(gen/logprob/update: medians over the --repeats timed steps, after --warmup untimed ones, of the per-step
ratio trainer phase / HF baseline; sync_vs_copy: median sync / median copy; overhead_frac: median per-step
share of timing_s/step outside the five phases).  The ratios of the medians are printed too.
"""
import argparse
import os
import signal
import subprocess
import sys
import time
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ppo_step_baselines import HFBaselines, copy_seconds, median  # noqa: E402
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k")
PHASES = ("gen", "reward", "old_log_prob", "update_actor", "update_weights")


def build_model(path, a):
    """The benchmark model (random Llama + the quickstart tiny tokenizer), cached in `path`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from rlhf.quickstart.tiny import make_tiny_tokenizer

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return
    tok = make_tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.02 * torch.randn_like(p)) if "norm" in n else p.normal_(0.0, 0.02)
    model.generation_config = GenerationConfig(eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                                               bos_token_id=cfg.bos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def overrides(a, model_dir, out_dir):
    gsm = os.path.abspath(a.gsm8k)
    return [f"model.path={model_dir}", f"trainer.default_local_dir={out_dir}", "algorithm=grpo",
            f"data.train_files={gsm}/train.jsonl", f"data.val_files={gsm}/test.jsonl", "data.max_train_samples=256",
            f"data.train_batch_size={a.prompts}", f"data.max_response_length={a.response_length}",
            f"rollout.n={a.n}", "rollout.temperature=0", "rollout.dtype=float32", "critic.enable=false",
            "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false", f"actor.ppo_mini_batch_size={a.prompts}",
            f"actor.ppo_micro_batch_size_per_gpu={a.micro}",
            f"actor.log_prob_micro_batch_size_per_gpu={a.prompts * a.n}", f"rollout.weight_sync_bucket_mb={a.sync_bucket_mb}",
            f"trainer.total_training_steps={a.warmup + a.repeats}", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=[console]",
            *(["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={a.dynamic_bsz}"] if a.dynamic_bsz else [])]


class Recorder:
    """Wraps the trainer's own objects (instance attributes only) to keep what each step produced."""

    def __init__(self, trainer):
        import psutil

        self.steps, self.cur = [], None
        self.me = psutil.Process()
        wrap(trainer.actor, "compute_log_prob", self.on_log_prob)
        wrap(trainer.actor, "update_policy", self.on_update)
        wrap(trainer.rollout.bridge, "sync", self.on_sync)
        if trainer.rollout.manager is not None:
            wrap(trainer.rollout.manager, "generate", self.on_generate)

    def child_cpu(self):
        """CPU seconds used so far by this process's children (Ray, engine actor, SGLang processes)."""
        total = 0.0
        for p in self.me.children(recursive=True):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except Exception:  # noqa: BLE001 - a child that just exited
                pass
        return total

    def begin(self):
        self.cur = {"cpu0": self.child_cpu()}
        self.steps.append(self.cur)

    def end(self, metrics):
        self.cur["cpu_total"] = self.child_cpu() - self.cur["cpu0"]
        self.cur["timing"] = metrics

    def rss(self, what):
        if os.environ.get("PPO_STEP_DEBUG_MEM"):
            print(f"[mem rank {os.environ['RANK']}] {what}: rss {self.me.memory_info().rss / 2**20:.0f} MB", flush=True)

    def on_generate(self, fn, *args, **kwargs):
        c0, t0 = self.child_cpu(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.rss("after generate")
        self.cur.update(engine_generate=time.perf_counter() - t0, cpu_gen=self.child_cpu() - c0, samples=out)
        return out

    def on_log_prob(self, fn, batch, **kwargs):
        c0, t0 = self.child_cpu(), time.perf_counter()
        out = fn(batch, **kwargs)
        self.rss("after log_prob")
        self.cur.setdefault("batch", batch)  # the dict train_step keeps filling (advantages, old_log_probs)
        self.cur.update(cpu_train=self.child_cpu() - c0, wall_train=time.perf_counter() - t0)
        return out

    def on_update(self, fn, *args, **kwargs):
        c0, t0 = self.child_cpu(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.rss("after update")
        self.cur["cpu_train"] += self.child_cpu() - c0
        self.cur["wall_train"] += time.perf_counter() - t0
        return out

    def on_sync(self, fn, *args, **kwargs):
        self.rss("before sync")
        stats = fn(*args, **kwargs)
        self.rss("after sync")
        self.cur["sync_stats"] = stats
        return stats


def wrap(obj, name, hook):
    fn = getattr(obj, name)
    setattr(obj, name, lambda *args, **kwargs: hook(fn, *args, **kwargs))


def start_py_spy(out_dir, pid, tag):
    os.makedirs(out_dir, exist_ok=True)
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "50", "--format", "raw", "--nonblocking", "--idle",
                             "--subprocesses", "-o", os.path.join(out_dir, f"{tag}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(a):
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from rlhf.config import compose_config
    from parallel.distributed import init_distributed
    from rlhf.trainer.ppo_trainer import PPOTrainer

    rank = int(os.environ["RANK"])
    model_dir, out_dir = os.path.join(a.workdir, f"model_{a.layers}x{a.hidden}_v{a.vocab}"), os.path.join(a.workdir, "out")

    def log(msg):
        if rank == 0:
            print(f"[ppo_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    init_distributed()  # idempotent: PPOTrainer calls it again
    if rank == 0:
        build_model(model_dir, a)
    dist.barrier()
    cfg = compose_config(overrides(a, model_dir, out_dir), recipe="gsm8k_ppo_tiny_cpu")
    t0 = time.time()
    trainer = PPOTrainer(cfg)
    n_params = sum(p.numel() for c in trainer.actor.chunks for p in c.parameters())
    log(f"trainer + engine up in {time.time() - t0:.1f} s; actor {n_params / 1e6:.1f} M params per TP rank; "
        f"load average {os.getloadavg()}")
    rec = Recorder(trainer)
    hf = None
    if rank == 0 and not a.no_baselines:
        hf = HFBaselines(model_dir, cfg, a.response_length, trainer.rollout.train_sampling.stop_token_ids,
                         trainer.tokenizer.pad_token_id, a.hf_threads)
    metrics, base, spies = [], [], []
    for step in range(1, a.warmup + a.repeats + 1):
        if step == a.warmup + 1 and a.py_spy:
            spies.append(start_py_spy(a.py_spy, os.getpid(), f"rank{rank}"))
        dist.barrier()
        rec.begin()
        t0 = time.perf_counter()
        m = trainer.train_step(step)
        m["timing_s/step"] = time.perf_counter() - t0
        rec.end(m)
        metrics.append(m)
        line = " ".join(f"{k[9:]}={m[k]:.3f}" for k in sorted(m) if k.startswith("timing_s/"))
        if hf is not None and not spies:  # the baselines right after the step: same load, same data
            b = hf.step(rec.steps[-1], probe_log=log if step == 1 else None)
            base.append(b)
            line += f" | HF gen={b['gen']:.3f} logprob={b['logprob']:.3f} update={b['update']:.3f}"
            if not b["tokens_equal"]:
                line += " (HF generated a different number of tokens: EOS reached)"
        log(f"step {step}: {line}; load {os.getloadavg()[0]:.1f}")
        dist.barrier()
    for s in spies:
        s.send_signal(signal.SIGINT)
        s.wait()
    dist.barrier()
    timed = metrics[a.warmup:]
    t = {k: median([m[f"timing_s/{k}"] for m in timed]) for k in PHASES + ("step",)}
    overhead = median([(m["timing_s/step"] - sum(m[f"timing_s/{k}"] for k in PHASES)) / m["timing_s/step"]
                       for m in timed])
    stats = rec.steps[-1]["sync_stats"]
    if rank == 0:
        report(a, t, overhead, rec.steps[a.warmup:], stats, base[a.warmup:], log)
    dist.barrier()
    trainer.close()
    dist.destroy_process_group()


def report(a, t, overhead, sw, stats, base, log):
    """Rank 0: the trainer's medians, the diagnostics, the baselines and the last line."""
    log(f"trainer medians over {len(sw)} steps: " + " ".join(f"{k}={v:.3f}s" for k, v in t.items())
        + f"; engine generate alone {median([s['engine_generate'] for s in sw]):.3f}s; overhead_frac={overhead:.4f}")
    log("CPU s/step of rank 0's children (Ray + engine): during generate "
        f"{median([s['cpu_gen'] for s in sw]):.2f}, during old_log_prob + update_actor "
        f"{median([s['cpu_train'] for s in sw]):.2f} (of {median([s['wall_train'] for s in sw]):.2f} s wall), "
        f"whole step {median([s['cpu_total'] for s in sw]):.2f}")
    pad_eff = median([float(s["batch"]["attention_mask"].float().mean()) for s in sw])
    resp_share = median([float(s["batch"]["response_mask"].sum() / s["batch"]["attention_mask"].sum()) for s in sw])
    trainer_eff = median([s["timing"].get("perf/padding_efficiency", float("nan")) for s in sw])
    log(f"batch [N, P + R] = {list(sw[-1]['batch']['input_ids'].shape)}: padding efficiency (real / processed "
        f"tokens) {pad_eff:.3f} padded, {trainer_eff:.3f} as run (perf/padding_efficiency"
        f"{', dynamic batching %d tokens' % a.dynamic_bsz if a.dynamic_bsz else ''}), response tokens "
        f"{resp_share:.3f} of the real tokens")
    log(f"weight sync: {stats.bytes / 1e6:.1f} MB, plan {stats.plan_seconds:.3f} s, gather+convert+pack "
        f"{stats.produce_seconds:.3f} s, delivery {stats.deliver_seconds:.3f} s, end+flush {stats.finish_seconds:.3f} s")
    if not base:
        print("ppo_step: no baselines (--no-baselines or --py-spy)", flush=True)
        return
    t_copy = copy_seconds(stats.bytes)
    log(f"plain copy of {stats.bytes / 1e6:.1f} MB (1 thread): {t_copy * 1e3:.1f} ms -> {stats.bytes / t_copy / 1e9:.2f} GB/s")
    hf = {k: median([b[k] for b in base]) for k in ("gen", "logprob", "update")}
    log(f"HF medians ({a.hf_threads} threads): " + " ".join(f"{k}={v:.3f}s" for k, v in hf.items()))
    pairs = {"gen": "gen", "old_log_prob": "logprob", "update_actor": "update"}
    paired = {k: median([m / b[v] for m, b in zip(sw_times(sw, k), base)]) for k, v in pairs.items()}
    log("ratios of medians: " + " ".join(f"{k}={t[k] / hf[v]:.2f}" for k, v in pairs.items())
        + "; medians of the per-step ratios (last line): " + " ".join(f"{k}={v:.2f}" for k, v in paired.items()))
    log(f"load average at the end {os.getloadavg()}")
    print(f"ppo_step: gen_vs_hf={paired['gen']:.2f} logprob_vs_hf={paired['old_log_prob']:.2f} "
          f"update_vs_hf={paired['update_actor']:.2f} sync_vs_copy={t['update_weights'] / t_copy:.1f} "
          f"overhead_frac={overhead:.4f}", flush=True)


def sw_times(sw, phase):
    return [s["timing"][f"timing_s/{phase}"] for s in sw]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (data.train_batch_size)")
    ap.add_argument("--n", type=int, default=2, help="responses per prompt (rollout.n)")
    ap.add_argument("--micro", type=int, default=4, help="actor.ppo_micro_batch_size_per_gpu (sequences)")
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--dynamic-bsz", type=int, default=None, metavar="TOKENS",
                    help="actor.use_dynamic_bsz with this actor.ppo_max_token_len_per_gpu (docs/dynamic_batching.md)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hf-threads", type=int, default=2)
    ap.add_argument("--sync-bucket-mb", type=int, default=16,
                    help="rollout.weight_sync_bucket_mb of the step")
    ap.add_argument("--gsm8k", default=GSM8K)
    ap.add_argument("--no-baselines", action="store_true", help="trainer phases only (for profiling runs)")
    ap.add_argument("--py-spy", default=None, help="directory for py-spy raw profiles of the timed steps")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "rlhf_ppo_step_bench"))
    args = ap.parse_args()
    if "RANK" not in os.environ:
        from torchrun_relay import relay

        relay(__file__, sys.argv[1:], 'ppo_step: ')
    else:
        main(args)
