"""Convert checkpoints between Hugging Face and megatron-core dist_checkpointing formats.

    python scripts/convert_checkpoint.py hf-to-mcore --hf-path H --out M --tp T --pp P
    python scripts/convert_checkpoint.py mcore-to-hf --mcore-path M --out H2 [--tp T --pp P]

`H` is a local directory or a hub name. The megatron checkpoint `M` is layout independent
(dist_checkpointing reshards on load); `--tp/--pp` choose how many processes do the work. The
HF config and tokenizer travel inside `M/hf/` so the way back needs nothing else. Without
torchrun, the script relaunches itself with tp*pp local processes (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron dist checkpoint")
    a.add_argument("--hf-path", required=True)
    a.add_argument("--out", required=True)
    b = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF directory")
    b.add_argument("--mcore-path", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    for p in (a, b):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return ap.parse_args(argv)


def relaunch(args) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.tp * args.pp}",
           f"--master_port={port}", os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(cmd)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ and args.tp * args.pp > 1:
        return relaunch(args)
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from rlhf.mcore.distributed import destroy_distributed, init_distributed, init_model_parallel, set_seed
    from rlhf.mcore.models import build_model_chunks

    init_distributed()
    if dist.get_world_size() != args.tp * args.pp:
        raise SystemExit(f"world size {dist.get_world_size()} != tp*pp = {args.tp * args.pp}; "
                         f"launch exactly tp*pp processes")
    init_model_parallel(args.tp, args.pp)
    set_seed(0)
    if args.command == "hf-to-mcore":
        from rlhf.mcore.dist_checkpoint import save_sharded

        hf_path = args.hf_path
        if not os.path.isdir(hf_path):
            from huggingface_hub import snapshot_download

            hf_path = snapshot_download(hf_path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
        config = AutoConfig.from_pretrained(hf_path)
        bundle = build_model_chunks(config, "actor", hf_path,
                                    make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        tmp = args.out.rstrip("/") + ".tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        save_sharded(tmp, bundle.chunks, common={"format": "rlhf-mcore-v1"})
        if dist.get_rank() == 0:
            hf_dir = os.path.join(tmp, "hf")
            os.makedirs(hf_dir, exist_ok=True)
            for f in os.listdir(hf_path):
                if f.endswith(".json") and "safetensors" not in f or f.startswith("tokenizer") or f.endswith(".model"):
                    shutil.copy(os.path.join(hf_path, f), hf_dir)
            shutil.rmtree(args.out, ignore_errors=True)
            os.replace(tmp, args.out)
            print(f"wrote megatron checkpoint {args.out} (from {args.hf_path}, tp={args.tp} pp={args.pp})")
    else:
        from rlhf.mcore.dist_checkpoint import load_sharded
        from rlhf.mcore.convert import save_hf_checkpoint

        hf_dir = os.path.join(args.mcore_path, "hf")
        if not os.path.isdir(hf_dir):
            raise SystemExit(f"{args.mcore_path!r} has no hf/ config directory; was it written by hf-to-mcore "
                             f"or by the trainer's HF export?")
        config = AutoConfig.from_pretrained(hf_dir)
        bundle = build_model_chunks(config, "actor", make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        load_sharded(args.mcore_path, bundle.chunks)
        tokenizer = None
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        except Exception:
            pass
        dtype = getattr(torch, args.dtype) if args.dtype else None
        save_hf_checkpoint(bundle.chunks, bundle.spec, config, args.out, tokenizer=tokenizer, dtype=dtype)
        if dist.get_rank() == 0:
            print(f"wrote Hugging Face checkpoint {args.out}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
