"""Megatron-level checks on ONE GPU with only torch + megatron-core + transformers installed: what the
product smoke (scripts/gpu_smoke.py, recipe gpu_smoke) does not measure: HF parity of log-probs and values in
bf16, the memory plan against the allocator's peaks, the DPO step and the HF export.

    python scripts/gpu_smoke_megatron.py              # CUDA, a ~0.2B Qwen2-shaped model, under 10 minutes
    python scripts/gpu_smoke_megatron.py --device cpu # dry run of the same checks on the CPU (tiny model)

Prints the GPU's name, one ``CHECK <name> PASS|FAIL <detail>`` line per check, ``MEMORY`` lines (peak vs
plan per phase) and a ``SUMMARY``; exits 1 when a check fails.  `tests/e2e/test_gpu_smoke_megatron.py` runs it (the
``gpu`` marker: skipped without CUDA; the CPU dry run is a ``slow`` test).

It goes through the functions the trainer uses, one level below the worker classes (which are being
restructured): `parallel.models.build_model_chunks` (bf16 actor, critic, reference from an HF
checkpoint), `parallel.forward.forward_backward` (old/ref log-probs, values, the actor and critic
updates, a DPO step) with `rlhf.algorithms`' losses, `parallel.optim` (megatron DDP + optimizer,
guarded step), `parallel.dist_checkpoint` (save/load), `parallel.convert.save_hf_checkpoint`
(HF export) and `rlhf.memory_plan.planner` (estimate vs `torch.cuda.max_memory_allocated`, within 20%).
Without Transformer Engine it sets ``RLHF_ALLOW_NO_TE=1`` (megatron's local spec, torch Adam).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RESULTS: list[tuple[str, bool]] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"CHECK {name} {'PASS' if ok else 'FAIL'} {detail}", flush=True)
    RESULTS.append((name, ok))


def run_check(name: str, fn, box: dict | None = None) -> None:
    """Run `fn() -> (ok, detail[, value])`; an exception is a FAIL with its message (the next checks still run)."""
    try:
        out = fn()
        ok, detail = out[0], out[1]
        if box is not None and len(out) > 2:
            box[name] = out[2]
    except Exception as e:  # noqa: BLE001  (one failing check must not hide the others)
        traceback.print_exc()
        ok, detail = False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
    report(name, ok, detail)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size", choices=["tiny", "small"], default=None, help="default: small on cuda, tiny on cpu")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--tolerance", type=float, default=0.20, help="memory plan vs measured, relative")
    args = ap.parse_args(argv)
    args.size = args.size or ("small" if args.device == "cuda" else "tiny")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP no CUDA device; run with --device cpu for the dry run", flush=True)
        return 0
    import gpu_smoke_lib as lib

    from parallel.kernels import module_available

    if args.device == "cuda" and not module_available("transformer_engine"):
        os.environ.setdefault("RLHF_ALLOW_NO_TE", "1")
    lib.set_single_process_env()
    start = time.time()
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)"
    print(f"GPU {name} torch={torch.__version__} size={args.size}", flush=True)
    from parallel.distributed import init_distributed, init_model_parallel, set_seed

    init_distributed()
    init_model_parallel(1, 1)
    set_seed(1234)
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_smoke_")
    from gpu_smoke_checks import SmokeRun

    run = SmokeRun(args.size, args.device, workdir, args.tolerance)
    for check in run.checks():
        run_check(check.__name__.removeprefix("check_"), check)
    for line in run.memory_lines:
        print(line, flush=True)
    failed = [n for n, ok in RESULTS if not ok]
    print(f"SUMMARY {len(RESULTS) - len(failed)} passed, {len(failed)} failed in {time.time() - start:.0f} s"
          + (f" (failed: {', '.join(failed)})" if failed else ""), flush=True)
    from parallel.distributed import destroy_distributed

    destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
