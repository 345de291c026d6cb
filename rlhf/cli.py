"""The `rlhf` console command.

    rlhf launch --algorithm grpo --model_name_or_path Qwen/Qwen2.5-7B-Instruct \\
        --dataset_name data/gsm8k/train.jsonl --output_dir outputs/grpo [--nproc 8] [key=value ...]
    rlhf launch ... --slurm          # print the sbatch command of the algorithm's GPU recipe instead
    rlhf launch ... --dry_run        # print the torchrun command without running it

`launch` builds the same overrides as the Python API (:func:`rlhf.api.build_overrides`:
``algorithm=NAME``, then the named options, then ``key=value`` config overrides), checks them by
composing the config, then runs ``torchrun --standalone --nproc_per_node=N -m rlhf.main ...`` on this
node (N defaults to the number of GPUs, 1 without).  ``--slurm`` prints
``sbatch recipes/<recipe>/run_slurm.sbatch <overrides>`` for the recipe (``--recipe``, default the
algorithm's GPU recipe, :data:`SLURM_RECIPES`), to submit from the repository root.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
#: algorithm -> the multi-GPU recipe whose run_slurm.sbatch `--slurm` points at
SLURM_RECIPES = {"ppo": "gsm8k_ppo_qwen2_7b", "grpo": "grpo_qwen2_7b", "dr_grpo": "grpo_qwen2_7b",
                 "rloo": "grpo_qwen2_7b", "reinforce_plus_plus": "grpo_qwen2_7b",
                 "reinforce_plus_plus_baseline": "grpo_qwen2_7b", "dapo": "dapo_qwen2_7b", "dpo": "dpo_qwen2_7b"}


def _parser() -> argparse.ArgumentParser:
    from rlhf.api import ALGORITHMS

    p = argparse.ArgumentParser(prog="rlhf", description="RLHF post-training (megatron-core + SGLang).")
    sub = p.add_subparsers(dest="command", required=True)
    la = sub.add_parser("launch", help="train on this node with torchrun (or print the Slurm command)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    la.add_argument("--algorithm", choices=sorted(ALGORITHMS), default=None,
                    help="algorithm preset (default: the recipe's, else PPO with GAE)")
    la.add_argument("--model_name_or_path", help="actor model: HF directory or hub name (model.path)")
    la.add_argument("--critic_model", help="critic initialisation for --algorithm ppo (model.critic_path)")
    la.add_argument("--reward_model", help="HF reward model, or file.py[:function] reward function")
    la.add_argument("--dataset_name", help="training data: parquet/jsonl file(s), directory or embedded://...")
    la.add_argument("--val_dataset_name", help="validation data (default: --dataset_name)")
    la.add_argument("--output_dir", help="trainer.default_local_dir (checkpoints, TensorBoard, HF export)")
    la.add_argument("--recipe", help="recipe to start from (rlhf/config/recipe/<name>.yaml)")
    la.add_argument("--nproc", type=int, default=None, help="trainer processes on this node")
    la.add_argument("--slurm", action="store_true", help="print the sbatch command instead of running")
    la.add_argument("--dry_run", action="store_true", help="print the torchrun command instead of running")
    la.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p


def _abs(path: Optional[str]) -> Optional[str]:
    """Existing local paths become absolute (the Slurm job runs from the repository root)."""
    if path and "://" not in path and os.path.exists(path.split(".py:")[0] + (".py" if ".py:" in path else "")):
        return os.path.abspath(path)
    return path


def launch_commands(args) -> tuple[list[str], dict]:
    """(argv, extra env) of the torchrun run, or of the sbatch submission with --slurm."""
    from rlhf.api import build_overrides
    from rlhf.config import compose_config

    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise ValueError(f"not key=value overrides: {bad}")
    overrides = build_overrides(args.algorithm, _abs(args.model_name_or_path), args.critic_model and
                                _abs(args.critic_model), _abs(args.reward_model), _abs(args.dataset_name),
                                _abs(args.val_dataset_name), args.output_dir and os.path.abspath(args.output_dir),
                                args.overrides)
    if args.slurm:
        recipe = args.recipe or SLURM_RECIPES.get(args.algorithm or "ppo")
        compose_config(overrides, recipe=recipe)  # fail here, not in the queue
        return ["sbatch", f"recipes/{recipe}/run_slurm.sbatch", *overrides], {}
    compose_config(overrides, recipe=args.recipe)
    import torch

    nproc = args.nproc or max(1, torch.cuda.device_count())
    env = {} if torch.cuda.is_available() else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={nproc}", "-m", "rlhf.main", *([f"recipe={args.recipe}"] if args.recipe else []),
            *overrides]
    return argv, env


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rlhf.config import ConfigError

    args = _parser().parse_args(argv)
    try:
        cmd, env = launch_commands(args)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"rlhf launch: {e}", file=sys.stderr)
        return 2
    line = " ".join(shlex.quote(c) for c in cmd)
    if args.slurm:
        print(f"cd {shlex.quote(str(REPO))} && {line}")
        return 0
    print(("" if not env else " ".join(f"{k}={v}" for k, v in env.items()) + " ") + line, flush=True)
    if args.dry_run:
        return 0
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.call(cmd, env={**os.environ, **env, "PYTHONPATH": pythonpath})


if __name__ == "__main__":
    sys.exit(main())
