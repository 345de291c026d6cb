"""GPU smoke test of the product path: `python -m rlhf.main recipe=gpu_smoke` twice (steps 1-3, then a resume
to step 4), then checks on what the runs wrote (scripts/gpu_smoke_run.py).

    python scripts/gpu_smoke.py                    # one GPU: TP1, one colocated SGLang engine (memory saver)
    python scripts/gpu_smoke.py --device cpu       # the same recipe on the CPU (CPU engine, gloo): CI's dry run
    python scripts/gpu_smoke.py --gpus 2           # 2 GPUs, via torchrun: DP2, TP2, CP2 (TE) and disaggregated (1 + 1)
    python scripts/gpu_smoke.py --gpus 2 --print-commands   # the command lines only

Prints one ``CHECK <name> PASS|FAIL <detail>`` line per check (prefixed by the layout with --gpus 2) and a
``SUMMARY``; exits 1 when a check fails.  Each run's output goes to ``<workdir>/<layout>/run{1,2}.log``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
#: the CPU form: the CPU SGLang engine and gloo come from hiding CUDA (rlhf picks both when CUDA is absent);
#: float32 as the CPU recipes run
CPU_OVERRIDES = ("model.dtype=float32",)
#: --gpus 2 layouts: (name, ranks, overrides); the disaggregated engine takes the GPU the trainer leaves
LAYOUTS_2GPU = (("dp2", 2, ()), ("tp2", 2, ("parallel.tensor_model_parallel_size=2",)),
                ("cp2", 2, ("parallel.context_parallel_size=2",)),  # needs Transformer Engine
                ("disaggregated", 1, ("rollout.mode=disaggregated",)))


def commands(layout: str, ranks: int, overrides, run_dir: str, device: str) -> list[list[str]]:
    """The two command lines of one layout: steps 1-3, then steps to 4 resuming from the latest checkpoint."""
    if ranks > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={ranks}"]
    else:
        head = [sys.executable]
    base = head + ["-m", "rlhf.main", "recipe=gpu_smoke", f"trainer.default_local_dir={run_dir}",
                   *(CPU_OVERRIDES if device == "cpu" else ()), *overrides]
    return [base, base + ["trainer.total_training_steps=4"]]


def run_env(device: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core: TP/SP comms ordered with compute
    return env


def run_layout(layout, ranks, overrides, workdir, device, timeout) -> tuple[tuple, tuple]:
    """Runs both invocations of one layout; returns (exit codes, log texts)."""
    run_dir = os.path.join(workdir, layout)
    os.makedirs(run_dir, exist_ok=True)
    rcs, logs = [], []
    for i, cmd in enumerate(commands(layout, ranks, overrides, run_dir, device), 1):
        print(f"RUN {layout} {i}: {shlex.join(cmd)}", flush=True)
        log_path = os.path.join(run_dir, f"run{i}.log")
        t0 = time.time()
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=run_env(device), stdout=log, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        text = open(log_path, errors="replace").read()
        print(f"RAN {layout} {i}: exit {rc} in {time.time() - t0:.0f} s (log {log_path})", flush=True)
        if rc != 0:
            print("\n".join(text.splitlines()[-25:]), flush=True)
        rcs.append(rc)
        logs.append(text)
    return tuple(rcs), tuple(logs)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--gpus", type=int, choices=[1, 2], default=1, help="2: the DP2 / TP2 / disaggregated layouts")
    ap.add_argument("--workdir", default=None, help="run directories (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per invocation")
    ap.add_argument("--val-tolerance", type=float, default=None,
                    help="|val/score step 1 - step 0| allowed (default: 0 on cpu, 0.125 on cuda: 1 of 8 greedy "
                         "validation answers may flip with GPU kernels' nondeterminism)")
    ap.add_argument("--print-commands", action="store_true", help="print the command lines and exit")
    args = ap.parse_args(argv)
    if args.gpus > 1 and args.device == "cpu":
        ap.error("--gpus 2 needs --device cuda (the CPU form is one process)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_smoke_run import check_run

    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_smoke_")
    layouts = LAYOUTS_2GPU if args.gpus == 2 else (("gpu1" if args.device == "cuda" else "cpu", 1, ()),)
    if args.print_commands:
        for layout, ranks, overrides in layouts:
            for cmd in commands(layout, ranks, overrides, os.path.join(workdir, layout), args.device):
                print(shlex.join(cmd))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("SKIP no CUDA device; run with --device cpu for the dry run", flush=True)
            return 0
        if torch.cuda.device_count() < args.gpus:
            print(f"SKIP --gpus {args.gpus} but {torch.cuda.device_count()} CUDA device(s)", flush=True)
            return 0
        print(f"GPU {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()} torch={torch.__version__}")
    tol = args.val_tolerance if args.val_tolerance is not None else (0.0 if args.device == "cpu" else 0.125)
    start, results = time.time(), []
    for layout, ranks, overrides in layouts:
        rcs, logs = run_layout(layout, ranks, overrides, workdir, args.device, args.timeout)
        for name, ok, detail in check_run(os.path.join(workdir, layout), rcs, logs, tol):
            name = name if len(layouts) == 1 else f"{layout}/{name}"
            print(f"CHECK {name} {'PASS' if ok else 'FAIL'} {detail}", flush=True)
            results.append((name, ok))
    failed = [n for n, ok in results if not ok]
    print(f"SUMMARY {len(results) - len(failed)} passed, {len(failed)} failed in {time.time() - start:.0f} s"
          + (f" (failed: {', '.join(failed)})" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
