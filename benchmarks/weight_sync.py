"""Benchmark: weight sync (megatron TP2 -> one SGLang engine) against a plain copy and against SGLang's own
loading from disk, on the same weights, in the same run.

    python benchmarks/weight_sync.py                # launches torchrun with 2 processes itself
    python benchmarks/weight_sync.py --layers 4     # smaller/faster
    python benchmarks/weight_sync.py --quick        # iteration: no disk load / export_load; its last line is
                                                    # `weight_sync_quick: vs_copy=... cpu_floor_vs_copy=...
                                                    # gather_floor_vs_copy=... recv_floor_vs_copy=...
                                                    # tiny_sync_ms=... load1=...`

Model: random Llama (hidden 1024, 16 heads / 8 KV heads, FFN 2816, vocab 32000, untied, fp32; 8 layers =
160 M parameters, 640 MB).  Trainer: megatron-core TP2 on 2 gloo processes.  Engine: one SGLang engine (rollout
TP 1, fp32; a RolloutManager on rank 0).  A second engine serves the quickstart-sized model (0.25 MB synced).

Timed (medians of --repeats syncs, 15 by default, after one untimed warm-up, so imports, first-touch page faults
and the engine's first load are excluded; the warm-up is reported):
  * bridge      -- `WeightBridge.sync()` with its defaults: the product path, the one a GPU run takes (the stage
                   leader TP-gathers each parameter, converts it to HF tensors and packs 512 MB of buckets, two
                   halves, laid out as SGLang's FlattenedTensorBucket; the engine loads each through SGLang's
                   `load_weights`, bucket k+1 produced while bucket k loads): plan check, gather + convert + pack,
                   engine load, session end, flush.  Phase split (medians over the timed syncs, rank 0): plan (plan
                   check + opening the engines' sessions), writes (waiting for this rank's own buckets: gathers,
                   conversion, packing), engine load (waiting for the engines), end (closing the sessions);
  * copy        -- `dst.copy_(src)` of a flat buffer with the same number of bytes (rank 0), timed right after the
                   big-model syncs;
  * gather      -- a gloo `dist.gather` of half those bytes from rank 1 (what rank 1 holds at TP2): the TP gathers'
                   transport before 2026-12-07;
  * recv        -- the same bytes received into a preallocated buffer (one `batch_isend_irecv`): the transport of
                   the sync's TP gathers and their floor on this machine (on GPUs the same calls go to NCCL);
  * load        -- the engine's `update_weights_from_disk(dir)` of the same weights (safetensors written by
                   `save_hf_checkpoint`, file pages hot in the OS cache);
  * export_load -- `save_hf_checkpoint` from the TP shards + `update_weights_from_disk`: what a user without a
                   bridge does each step;
  * tiny        -- `WeightBridge.sync()` of the quickstart-sized model (the fixed cost of a sync), in ms; the
                   median of 3 x `--repeats` (at least 45) syncs: each takes milliseconds, and its median over 15
                   moved by 2x between runs on a shared 2-core host.
peak_extra_mb: the largest, over the two trainer ranks, of the memory the sync needs beyond the model: the
increase of resident memory during a timed sync (VmHWM after the sync minus VmRSS before it, VmHWM reset via
/proc/self/clear_refs) or, when larger, the bridge's persistent bucket buffers (allocated once, kept across syncs).

The machine's load average (1 min) is read before and after the timed part.  cpu_floor_vs_copy: the CPU the big
syncs keep busy, machine-wide (/proc/stat: the trainer ranks, the engine, Ray and the kernel's TCP work, in core-ms
per sync), divided by the number of cores and the plain copy: the vs_copy this path would reach with every core
busy all the time, its floor on this machine.

The LAST line printed is exactly
    weight_sync: vs_copy=<bridge/copy> cpu_floor_vs_copy=<CPU per sync/cores/copy>
      gather_floor_vs_copy=<gather/copy> recv_floor_vs_copy=<recv/copy>
      vs_export_load=<bridge/export_load> vs_load=<bridge/load> tiny_sync_ms=<ms> peak_extra_mb=<MB>
      first_sync_s=<bridge's first sync> load1=<start>/<end>
(one line).
"""
import argparse
import os
import sys
import time
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


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


def _busy_seconds():
    """Core-seconds this machine's CPUs were busy since boot (every process and the kernel: /proc/stat's user, nice,
    system, irq, softirq and steal; idle and iowait left out)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def median(xs):
    return sorted(xs)[len(xs) // 2]


def time_bridge(chunks, spec, engine, repeats, log, label, bucket_mb=512):
    """Warm-up sync, then `repeats` timed syncs; returns (median seconds, peak extra RSS MB, last stats, first sync
    seconds)."""
    import torch
    import torch.distributed as dist

    from rlhf.weight_bridge import WeightBridge, WeightSyncConfig

    bridge = WeightBridge(chunks, spec, engine, WeightSyncConfig(bucket_bytes=int(bucket_mb * 2**20)))
    t0 = time.perf_counter()
    first = bridge.sync()  # warm-up: imports, plan, first-touch of the buckets
    t_first = time.perf_counter() - t0
    log(f"bridge {label}: first sync {t_first:.2f} s (plan {first.plan_seconds:.2f} s)")
    times, rss_peaks, phases = [], [], []
    dist.barrier()
    busy0, t_all = _busy_seconds(), time.perf_counter()
    for _ in range(repeats):
        dist.barrier()
        hwm_ok = _reset_hwm()
        rss0 = _rss_kb("VmRSS")
        t0 = time.perf_counter()
        stats = bridge.sync()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        phases.append((stats.plan_seconds, stats.produce_seconds, stats.deliver_seconds, stats.finish_seconds,
                       stats.open_seconds, float(stats.replanned)))
        # resident growth during the sync, or the bridge's own (persistent) buffers if larger: they stay allocated
        rss = (_rss_kb("VmHWM") - rss0) / 1024 if hwm_ok else 0.0
        peak = torch.tensor([max(rss, stats.peak_extra_bytes / 2**20)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rss_peaks.append(peak.item())
    busy, t_all = _busy_seconds() - busy0, time.perf_counter() - t_all
    bridge.close()
    med = median(times)
    plan, writes, load, end, opening = (median([p[i] for p in phases]) * 1e3 for i in range(5))
    log(f"bridge {label}: {stats.bytes / 1e6:.2f} MB, {stats.num_buckets} bucket(s), median {med * 1e3:.1f} ms "
        f"(min {min(times) * 1e3:.1f}) of {[round(t * 1e3, 1) for t in times]} -> {stats.bytes / med / 1e9:.2f} GB/s; "
        f"rank 0 medians: plan "
        f"{plan:.1f} ms (of which waiting for the engines' sessions to open {opening:.1f} ms; "
        f"{sum(p[5] for p in phases):.0f} of {len(phases)} syncs planned afresh), writes {writes:.1f} ms, "
        f"engine load {load:.1f} ms, end {end:.1f} ms; peak extra "
        f"{max(rss_peaks):.0f} MB (bridge-accounted {stats.peak_extra_bytes / 2**20:.0f} MB, largest tensor "
        f"{max(p.numel() * p.element_size() for c in chunks for p in c.parameters()) * 2 / 2**20:.0f} MB gathered); "
        f"CPU busy {busy / repeats * 1e3:.0f} core-ms per sync ({busy / t_all:.2f} of {os.cpu_count()} cores busy)")
    return med, max(rss_peaks), stats, t_first, busy / repeats


def time_copy(rank, nbytes, repeats):
    """Rank 0: seconds of `repeats` copies of a flat buffer of `nbytes` (after one untimed copy); [] elsewhere."""
    import torch

    if rank != 0:
        return []
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def time_gather(nbytes, repeats, p2p=False):
    """Seconds (rank 0) of `repeats` gloo gathers of a flat buffer of `nbytes` from each rank of the world (after
    one untimed gather); ``p2p``: rank 1's buffer received into a preallocated one (one batch_isend_irecv), the
    transport of the sync's TP gathers (MegatronTopology.gather) and their floor on this machine; [] elsewhere."""
    import torch
    import torch.distributed as dist

    t = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if p2p:
            op = dist.irecv if dist.get_rank() == 0 else dist.isend
            for w in dist.batch_isend_irecv([dist.P2POp(op, out[1] if out else t, 1 - dist.get_rank())]):
                w.wait()
        else:
            dist.gather(t, gather_list=out, dst=0)
        if i:
            times.append(time.perf_counter() - t0)
    return times if dist.get_rank() == 0 else []


def make_checkpoints(work, layers, log):
    """Rank 0: the benchmark Llama and a quickstart-sized model (random, untrained)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf.quickstart.model import build_quickstart_model
    from rlhf.quickstart.tiny import make_tiny_tokenizer

    big, tiny = os.path.join(work, f"llama_{layers}l"), os.path.join(work, "quickstart")
    if not os.path.exists(os.path.join(big, "model.safetensors")):
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                          num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(1.0 + 0.02 * torch.randn_like(p)) if "norm" in n else p.normal_(0.0, 0.02)
        model.save_pretrained(big)
        make_tiny_tokenizer().save_pretrained(big)  # SGLang wants a tokenizer; ids only are used here
        del model
    build_quickstart_model(tiny, warmup_steps=0)
    log("checkpoints ready")
    return big, tiny


def main(args):
    warnings.filterwarnings("ignore")
    import shutil

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from parallel.convert import save_hf_checkpoint
    from parallel.distributed import init_distributed, init_model_parallel, set_seed
    from parallel.models import build_model_chunks

    init_distributed()
    rank = dist.get_rank()
    init_model_parallel(tp=2, pp=1)
    set_seed(0)

    def log(msg):
        if rank == 0:
            print(f"[weight_sync {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    work, export_dir = args.workdir, os.path.join(args.workdir, "export")
    paths = [None, None]
    if rank == 0:
        os.makedirs(work, exist_ok=True)
        paths = list(make_checkpoints(work, args.layers, log))
    dist.broadcast_object_list(paths, src=0)
    big, tiny = paths
    engines = {}
    if rank == 0:
        import ray

        from rlhf.rollout.manager import RolloutManager

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        t0 = time.time()
        engines = {"big": RolloutManager(1, dict(model_path=big, tp_size=1, dtype="float32", context_length=256)),
                   "tiny": RolloutManager(1, dict(model_path=tiny, tp_size=1, context_length=256))}
        log(f"engines started in {time.time() - t0:.1f} s")
    hf_config = AutoConfig.from_pretrained(big)
    actor = build_model_chunks(hf_config, "actor", big)
    with torch.no_grad():  # weights that differ from the checkpoint the engine booted with
        for c in actor.chunks:
            for p in c.parameters():
                p.mul_(1.01)
    load_start = os.getloadavg()[0]
    log(f"load average (1 min) at start: {load_start:.1f} on {os.cpu_count()} cores")
    copies = []
    t_bridge, peak_mb, stats, t_first, cpu_sync = time_bridge(actor.chunks, actor.spec, engines.get("big"),
                                                              args.repeats, log, "big")
    nbytes = stats.bytes
    copies += time_copy(rank, nbytes, args.repeats)
    gathers = time_gather(nbytes // 2, args.repeats)  # TP2: the half of the weights rank 1 holds
    recvs = time_gather(nbytes // 2, args.repeats, p2p=True)
    small = build_model_chunks(AutoConfig.from_pretrained(tiny), "actor", tiny)
    t_tiny = time_bridge(small.chunks, small.spec, engines.get("tiny"), max(3 * args.repeats, 45), log, "tiny")[0]

    t_copy = t_load = t_export_load = None
    if rank == 0:
        t_copy, t_gather, t_recv = median(copies), median(gathers), median(recvs)
        log(f"gloo gather of {nbytes / 2e6:.1f} MB from rank 1: median {t_gather * 1e3:.1f} ms "
            f"-> {nbytes / 2 / t_gather / 1e9:.2f} GB/s; gloo receive (the TP gathers' transport and floor): median "
            f"{t_recv * 1e3:.1f} ms -> {nbytes / 2 / t_recv / 1e9:.2f} GB/s")
        log(f"plain copy of {nbytes / 1e6:.1f} MB: median {t_copy * 1e3:.1f} ms "
            f"of {len(copies)} (min {min(copies) * 1e3:.1f}) -> {nbytes / t_copy / 1e9:.2f} GB/s")
        cpu_floor = cpu_sync / os.cpu_count() / t_copy  # the sync's CPU work spread perfectly over every core
    if args.quick:
        if rank == 0:
            for e in engines.values():
                e.shutdown()
            import ray

            ray.shutdown()
            print(f"weight_sync_quick: vs_copy={t_bridge / t_copy:.2f} cpu_floor_vs_copy={cpu_floor:.2f} "
                  f"gather_floor_vs_copy={t_gather / t_copy:.2f} "
                  f"recv_floor_vs_copy={t_recv / t_copy:.2f} "
                  f"tiny_sync_ms={t_tiny * 1e3:.1f} "
                  f"load1={load_start:.1f}/{os.getloadavg()[0]:.1f}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return
    # (b) export from the TP shards + SGLang's own load from disk (and the load alone)
    loads, export_loads = [], []
    for i in range(args.export_repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        save_hf_checkpoint(actor.chunks, actor.spec, hf_config, export_dir)
        dist.barrier()
        t_export = time.perf_counter() - t0
        if rank == 0:
            if i == 0:
                for f in os.listdir(big):  # tokenizer files for a complete HF directory
                    if f.startswith("tokenizer") or f == "special_tokens_map.json":
                        shutil.copy(os.path.join(big, f), export_dir)
            t0 = time.perf_counter()
            engines["big"].update_weights_from_disk(export_dir)
            t = time.perf_counter() - t0
            if i:  # the first round warms the file cache
                loads.append(t)
                export_loads.append(t_export + t)
    if rank == 0:
        t_load, t_export_load = median(loads), median(export_loads)
        log(f"update_weights_from_disk: {t_load:.3f} s; save_hf_checkpoint + update_weights_from_disk: "
            f"{t_export_load:.3f} s (medians of {args.export_repeats})")
        for e in engines.values():
            e.shutdown()
        import ray

        ray.shutdown()
    dist.barrier()
    if rank == 0:
        print(f"weight_sync: vs_copy={t_bridge / t_copy:.2f} cpu_floor_vs_copy={cpu_floor:.2f} "
              f"gather_floor_vs_copy={t_gather / t_copy:.2f} "
              f"recv_floor_vs_copy={t_recv / t_copy:.2f} "
              f"vs_export_load={t_bridge / t_export_load:.3f} "
              f"vs_load={t_bridge / t_load:.2f} tiny_sync_ms={t_tiny * 1e3:.1f} peak_extra_mb={peak_mb:.0f} "
              f"first_sync_s={t_first:.2f} "
              f"load1={load_start:.1f}/{os.getloadavg()[0]:.1f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15, help="timed syncs per path (medians)")
    ap.add_argument("--quick", action="store_true", help="leave out the disk load and export_load (iteration)")
    ap.add_argument("--export-repeats", type=int, default=3, help="timed save_hf_checkpoint + disk loads")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "rlhf_weight_sync_bench"))
    a = ap.parse_args()
    if "RANK" not in os.environ:
        from torchrun_relay import relay

        relay(__file__, sys.argv[1:], 'weight_sync_quick: ' if a.quick else 'weight_sync: ')
    else:
        main(a)
