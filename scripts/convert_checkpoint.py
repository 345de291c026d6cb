"""Convert checkpoints between Hugging Face and megatron-core dist_checkpointing formats.

    python scripts/convert_checkpoint.py hf-to-mcore --hf-path H --out M --tp T --pp P [--ep E]
    python scripts/convert_checkpoint.py mcore-to-hf --mcore-path M --out H2 [--tp T --pp P --ep E]
    python scripts/convert_checkpoint.py mcore-to-hf --ckpt RUN/checkpoints/global_step_N --out H2 [--hf-config D]

Every registered model family (parallel.convert.registry: Llama 2/3.x, Qwen2/2.5, Mistral,
Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3), experts included.  `H` is a local directory or a hub name; its
config.json is checked first (architecture, rope type, layout: exit code 2 with the supported
list) before any weight is downloaded.  The megatron checkpoint `M` is layout independent
(dist_checkpointing reshards on load); `--tp/--pp/--ep` choose how the work is split over
tp*pp*ep processes (`--ep`: expert parallelism, MoE only; `--num-layers-in-first/last-pipeline-
stage` for layer counts pp does not divide).  The HF config and tokenizer travel inside `M/hf/`
so the way back needs nothing else.  A run starts from `M` with `actor.use_dist_checkpointing=true
actor.dist_checkpointing_path=M` (any layout; parallel.init_checkpoint).  `--ckpt` takes a trainer
checkpoint (any TP/PP layout): its actor weights, with the config and tokenizer of the model the
run started from (model.path of `RUN/config.yaml`, or `--hf-config D`; rlhf.trainer.hf_source).
Without torchrun, the script relaunches itself with tp*pp*ep local processes (gloo on CPU, NCCL on
GPU).
"""
from __future__ import annotations

import argparse
import os
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
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--mcore-path", help="a checkpoint written by hf-to-mcore (with its hf/ folder)")
    src.add_argument("--ckpt", help="a trainer checkpoint <run>/checkpoints/global_step_<k> (its actor)")
    b.add_argument("--hf-config", default=None, help="with --ckpt: the HF model directory the run started from "
                                                     "(default: model.path of <run>/config.yaml)")
    b.add_argument("--out", required=True)
    b.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    for p in (a, b):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
        p.add_argument("--num-layers-in-first-pipeline-stage", type=int, default=None)
        p.add_argument("--num-layers-in-last-pipeline-stage", type=int, default=None)
        p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return ap.parse_args(argv)


def world_size(args) -> int:
    """tp * pp * ep processes: data parallel size ep, which expert parallelism subdivides."""
    return args.tp * args.pp * args.ep


def uneven(args) -> dict:
    return {k: v for k, v in (("num_layers_in_first_pipeline_stage", args.num_layers_in_first_pipeline_stage),
                              ("num_layers_in_last_pipeline_stage", args.num_layers_in_last_pipeline_stage)) if v}


def preflight(args, config_path: str) -> None:
    """Refuse an unsupported model or layout from config.json alone (exit code 2)."""
    from parallel.convert import UnsupportedModelError
    from parallel.preflight import check_model

    try:
        check_model(config_path, tp=args.tp, pp=args.pp, ep=args.ep, **uneven(args))
    except (UnsupportedModelError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


def init_parallel(args) -> None:
    """megatron parallel state (tp, pp and, for MoE, ep)."""
    from parallel.distributed import init_model_parallel

    init_model_parallel(args.tp, args.pp, ep=args.ep)


def relaunch(args) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size(args)}",
           f"--master_port={port}", os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(cmd)


def checkpoint_source(args):
    """mcore-to-hf: (dist checkpoint, HF config dir, tokenizer dir) of --mcore-path or --ckpt (exit 2 when the
    trainer checkpoint's model cannot be found)."""
    if not args.ckpt:
        hf_dir = os.path.join(args.mcore_path, "hf")
        return args.mcore_path, hf_dir, hf_dir
    from rlhf.trainer.hf_source import checkpoint_hf_source

    try:
        src = checkpoint_hf_source(args.ckpt, args.hf_config)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    return src.mcore_path, src.hf_dir, src.tokenizer_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "mcore-to-hf":
        args.mcore_path, hf_dir, tokenizer_dir = checkpoint_source(args)
    if "RANK" not in os.environ:
        config_path = args.hf_path if args.command == "hf-to-mcore" else hf_dir
        if args.command == "hf-to-mcore" or os.path.isdir(config_path):
            preflight(args, config_path)
        if world_size(args) > 1:
            return relaunch(args)
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from parallel.distributed import destroy_distributed, init_distributed, set_seed
    from parallel.models import build_model_chunks

    init_distributed()
    if dist.get_world_size() != world_size(args):
        raise SystemExit(f"world size {dist.get_world_size()} != tp*pp*ep = {world_size(args)}; "
                         f"launch exactly tp*pp*ep processes")
    init_parallel(args)
    set_seed(0)
    if args.command == "hf-to-mcore":
        from parallel.init_checkpoint import write_model_checkpoint

        hf_path = args.hf_path
        if not os.path.isdir(hf_path):
            from huggingface_hub import snapshot_download

            hf_path = snapshot_download(hf_path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
        config = AutoConfig.from_pretrained(hf_path)
        bundle = build_model_chunks(config, "actor", hf_path,
                                    make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, **uneven(args))
        write_model_checkpoint(hf_path, args.out, bundle.chunks)
        if dist.get_rank() == 0:
            print(f"wrote megatron checkpoint {args.out} (from {args.hf_path}, tp={args.tp} pp={args.pp} ep={args.ep})")
    else:
        from parallel.dist_checkpoint import load_sharded
        from parallel.convert import save_hf_checkpoint

        if not os.path.isdir(hf_dir):
            raise SystemExit(f"{args.mcore_path!r} has no hf/ config directory; was it written by hf-to-mcore "
                             f"or by the trainer's HF export?")
        config = AutoConfig.from_pretrained(hf_dir)
        bundle = build_model_chunks(config, "actor", make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                    **uneven(args))
        load_sharded(args.mcore_path, bundle.chunks)
        tokenizer = None
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else None
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
