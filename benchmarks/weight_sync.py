"""Benchmark: weight bridge (megatron TP2 -> one SGLang engine) against a plain copy and SGLang's
own `update_weights_from_disk`, on the same weights, in the same run.

    python benchmarks/weight_sync.py                # launches torchrun with 2 processes itself
    python benchmarks/weight_sync.py --layers 4     # smaller/faster

Model: random Llama (hidden 1024, 16 heads / 8 KV heads, FFN 2816, vocab 32000, untied, fp32;
8 layers = 159 M parameters, 636 MB).  Trainer: megatron-core TP2 on 2 gloo processes.  Engine:
one SGLang engine (rollout TP 1, fp32; a RolloutManager on rank 0, Ray actor).

Timed (after one untimed warm-up of each path, so imports, first-touch page faults and the
engine's first load are excluded; medians of --repeats runs):
  * bridge     -- `WeightBridge.sync()`: plan + validation against the engine, TP gathers,
                  conversion to HF layout, bucketing, delivery, end of session, cache flush.
                  Variants (--variants transport:bucket_mb:serial|overlap, comma-separated):
                  the default 512 MB buckets without overlap (the bridge's defaults, used for the
                  last line), 128 MB buckets with conversion overlapped with delivery, and the
                  disaggregated transport (gloo broadcast into the engine's weight-update group);
  * copy       -- `dst.copy_(src)` of a flat buffer with the same number of bytes (rank 0);
  * disk       -- `engine.update_weights_from_disk(dir)` of the same weights, exported with
                  `save_hf_checkpoint` (safetensors, file pages hot in the OS cache).
peak_extra_mb: the largest, over the two trainer ranks, increase of resident memory during a
timed sync (VmHWM after the sync minus VmRSS before it, with VmHWM reset via /proc/self/clear_refs);
the bridge's own accounting (bucket buffers + gathered/converted tensors) is printed too.

The LAST line printed is exactly
    weight_sync: vs_copy=<bridge/copy> vs_disk=<bridge/disk> peak_extra_mb=<MB>
"""
import argparse
import os
import re
import subprocess
import sys
import time
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


def _launch(argv):
    """Not under torchrun: start 2 processes with torchrun, relay their output, end with the result line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           os.path.abspath(__file__), *argv]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = None
    for line in proc.stdout:
        if line.startswith("weight_sync: "):
            result = line.strip()
        elif "Warning" not in line and "warnings.warn" not in line:
            sys.stdout.write(line)
            sys.stdout.flush()
    rc = proc.wait()
    if rc != 0 or result is None:
        print(f"benchmark failed (exit code {rc})", flush=True)
        sys.exit(rc or 1)
    print(result, flush=True)


def _rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def time_bridge(actor, engine, transport, bucket_mb, overlap, repeats, n_params, log):
    """Warm-up sync, then `repeats` timed syncs; returns (median seconds, peak extra RSS MB, stats)."""
    import torch
    import torch.distributed as dist

    from rlhf.mcore.weight_sync import WeightBridge

    bridge = WeightBridge(actor.chunks, actor.spec, engine, transport=transport,
                          bucket_bytes=int(bucket_mb * 2**20), overlap=overlap, group_prefix=f"bench_{time.time_ns()}")
    dist.barrier()
    # warm-up: imports, weight-update group creation ("distributed"), first-touch allocations
    stats = bridge.sync()
    times, rss_peaks, meter_peaks = [], [], []
    for _ in range(repeats):
        dist.barrier()
        hwm_ok = _reset_hwm()
        rss0 = _rss_kb("VmRSS")
        t0 = time.perf_counter()
        stats = bridge.sync()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        peak = (_rss_kb("VmHWM") - rss0) / 1024 if hwm_ok else float("nan")
        t = torch.tensor([peak, stats.peak_extra_bytes / 2**20], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rss_peaks.append(t[0].item())
        meter_peaks.append(t[1].item())
    bridge.close()
    med = sorted(times)[len(times) // 2]
    log(f"bridge ({transport}, {bucket_mb:g} MB buckets{', overlap' if overlap else ''}): {stats.bytes / 1e6:.1f} MB "
        f"({n_params / 1e6:.1f} M params at trainer TP2, {stats.num_buckets} buckets) in {med:.3f} s, median of "
        f"{[round(t, 3) for t in times]} -> {stats.bytes / med / 1e9:.2f} GB/s; rank 0, last sync: plan "
        f"{stats.plan_seconds:.3f} s, gather+convert+pack {stats.produce_seconds:.3f} s, delivery "
        f"{stats.deliver_seconds:.3f} s, end+flush {stats.finish_seconds:.3f} s; peak extra RSS {max(rss_peaks):.0f} MB, "
        f"bridge-accounted {max(meter_peaks):.0f} MB")
    return med, max(rss_peaks), stats


def main(args):
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, LlamaConfig

    from rlhf.mcore.distributed import init_distributed, init_model_parallel, set_seed
    from rlhf.mcore.convert import save_hf_checkpoint
    from rlhf.mcore.models import build_model_chunks
    init_distributed()
    rank = dist.get_rank()
    init_model_parallel(tp=2, pp=1)
    set_seed(0)

    def log(msg):
        if rank == 0:
            print(f"[weight_sync {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    work = args.workdir
    init_dir, export_dir = os.path.join(work, "init"), os.path.join(work, "export")
    if rank == 0:
        os.makedirs(work, exist_ok=True)
        if not os.path.exists(os.path.join(init_dir, "model.safetensors")):
            from transformers import AutoModelForCausalLM

            from tests.helpers.tiny_tokenizer import make_tiny_tokenizer

            cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512,
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(1.0 + 0.02 * torch.randn_like(p)) if "norm" in n else p.normal_(0.0, 0.02)
            model.save_pretrained(init_dir)
            make_tiny_tokenizer().save_pretrained(init_dir)  # SGLang wants a tokenizer; ids only are used here
            del model
        log("checkpoint ready; starting the engine")
    dist.barrier()
    engine = None
    if rank == 0:
        import ray

        from rlhf.rollout.manager import RolloutManager

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        t0 = time.time()
        engine = RolloutManager(1, dict(model_path=init_dir, tp_size=1, dtype="float32", context_length=256,
                                        random_seed=0))
        log(f"engine started in {time.time() - t0:.1f} s")
    hf_config = AutoConfig.from_pretrained(init_dir)
    actor = build_model_chunks(hf_config, "actor", init_dir)
    n_params = sum(p.numel() for c in actor.chunks for p in c.parameters())
    # make the actor's weights differ from the checkpoint the engine booted with
    with torch.no_grad():
        for c in actor.chunks:
            for p in c.parameters():
                p.mul_(1.01)
    variants = [v.split(":") for v in args.variants.split(",")]
    results = {}
    for transport, bucket_mb, overlap in variants:
        results[(transport, bucket_mb, overlap)] = time_bridge(
            actor, engine, transport, float(bucket_mb), overlap == "overlap", args.repeats, n_params, log)
    t_bridge, peak_mb, stats = results[tuple(variants[0])]
    nbytes = stats.bytes

    # (a) a plain copy of the same bytes
    t_copy = None
    if rank == 0:
        src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        t_copy = sorted(times)[2]
        del src, dst
        log(f"plain copy of {nbytes / 1e6:.1f} MB: {t_copy:.4f} s -> {nbytes / t_copy / 1e9:.2f} GB/s")

    # (b) SGLang's own update_weights_from_disk of the same weights
    save_hf_checkpoint(actor.chunks, actor.spec, hf_config, export_dir)
    t_disk = None
    if rank == 0:
        for f in os.listdir(init_dir):  # tokenizer files for a complete HF directory
            if f.startswith("tokenizer") or f == "special_tokens_map.json":
                import shutil

                shutil.copy(os.path.join(init_dir, f), export_dir)
        engine.call("update_weights_from_disk", export_dir)  # warm-up (file pages into the OS cache)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.call("update_weights_from_disk", export_dir)
            times.append(time.perf_counter() - t0)
        t_disk = sorted(times)[len(times) // 2]
        log(f"update_weights_from_disk: {t_disk:.3f} s median of {times}")
        # the bridge and the disk path load the same values: a quick consistency probe
        w = torch.tensor(engine.call("get_weights_by_name", "model.layers.0.mlp.down_proj.weight", truncate_size=2)[0])
        log(f"engine down_proj[0, :3] after both paths: {w[0, :3].tolist()}")
        engine.shutdown()
        ray.shutdown()
    dist.barrier()
    if rank == 0:
        log(f"final line: first variant {args.variants.split(',')[0]}")
        print(f"weight_sync: vs_copy={t_bridge / t_copy:.2f} vs_disk={t_bridge / t_disk:.2f} "
              f"peak_extra_mb={peak_mb:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default="tensor:512:serial,tensor:128:overlap,distributed:512:serial",
                    help="comma-separated transport:bucket_mb:serial|overlap; the first one gives the last line")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "rlhf_weight_sync_bench"))
    a = ap.parse_args()
    if "RANK" not in os.environ:
        _launch(sys.argv[1:])
    else:
        main(a)
