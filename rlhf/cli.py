"""The `rlhf` console command.

    rlhf launch --algorithm grpo --model_name_or_path Qwen/Qwen2.5-7B-Instruct \\
        --dataset_name data/gsm8k/train.jsonl --output_dir outputs/grpo [--nproc 8] [key=value ...]
    rlhf launch ... --slurm          # print the sbatch command of the algorithm's GPU recipe instead
    rlhf launch ... --dry_run        # print the torchrun command without running it
    rlhf sandbox serve --host 127.0.0.1 --port 8080   # a local SandboxFusion-compatible code sandbox
    rlhf retrieval serve --corpus corpus.jsonl --port 8000   # BM25 behind verl's search tool's /retrieve
    rlhf launch --algorithm ppo --model_name_or_path M --reward_model_name_or_path R --dataset_name D \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 8 --num_rollout_samples 128 \\
        --output_dir O --logging_steps 10 --save_steps 100          # the trl-style flags

`launch` builds the same overrides as the Python API (:func:`rlhf.api.build_overrides`:
``algorithm=NAME``, then the named options, then ``key=value`` config overrides), composes and fully
validates the config (data and model paths included) before printing or running anything, then runs
``torchrun --standalone --nproc_per_node=N -m rlhf.main ...`` on this node (N: ``--nproc``, else
trainer.n_gpus_per_node, else the number of GPUs, 1 without).  ``--slurm`` prints
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
    la.add_argument("--model_name_or_path",
                    help="actor model: HF directory, hub name or tiny://quickstart (model.path)")
    la.add_argument("--critic_model", help="critic initialisation for --algorithm ppo (model.critic_path)")
    la.add_argument("--reward_model", "--reward_model_name_or_path", dest="reward_model",
                    help="HF reward model, or file.py[:function] reward function")
    la.add_argument("--safety_reward_model", "--safety_reward_model_name_or_path", dest="safety_reward_model",
                    help="one more reward model (or file.py[:function]), added with --safety_reward_weight")
    la.add_argument("--safety_reward_weight", type=float, default=1.0)
    la.add_argument("--dataset_name", help="training data: parquet/jsonl file(s) or directory, a hub dataset "
                                           "(openai/gsm8k[:CONFIG][@SPLIT]) or embedded://...")
    la.add_argument("--val_dataset_name", help="validation data (default: --dataset_name)")
    la.add_argument("--output_dir", help="trainer.default_local_dir (checkpoints, TensorBoard, HF export)")
    la.add_argument("--per_device_train_batch_size", type=int,
                    help="sequences per forward/backward on each device (actor/critic.ppo_micro_batch_size_per_gpu)")
    la.add_argument("--gradient_accumulation_steps", type=int,
                    help="micro batches per optimizer step on each device: the mini batch is per_device x "
                         "accumulation x data-parallel size sequences (actor.ppo_mini_batch_size, in prompts)")
    la.add_argument("--num_rollout_samples", type=int,
                    help="responses generated per step: data.train_batch_size x rollout.n")
    la.add_argument("--logging_steps", type=int, help="write metrics every N steps (trainer.log_freq)")
    la.add_argument("--save_steps", type=int, help="checkpoint every N steps (trainer.save_freq)")
    la.add_argument("--learning_rate", type=float, help="actor.optim.lr")
    la.add_argument("--num_train_epochs", type=int, help="trainer.total_epochs")
    la.add_argument("--max_steps", type=int, help="trainer.total_training_steps")
    la.add_argument("--seed", type=int, help="trainer.seed")
    la.add_argument("--config", help="a YAML config file (verl's layout or ours), as python -m rlhf.main --config")
    la.add_argument("--recipe", help="recipe to start from (recipes/<name>/<name>.yaml)")
    la.add_argument("--nproc", type=int, default=None, help="trainer processes (default: trainer.n_gpus_per_node "
                                                           "x nnodes, else the GPUs of this node, 1 without)")
    la.add_argument("--slurm", action="store_true", help="print the sbatch command instead of running")
    la.add_argument("--dry_run", action="store_true", help="print the torchrun command instead of running")
    la.add_argument("overrides", nargs="*", help="config overrides key=value")
    sb = sub.add_parser("sandbox", help="the local code sandbox (SandboxFusion's HTTP API)").add_subparsers(
        dest="sandbox_command", required=True)
    from rlhf.sandbox.server import add_serve_args

    add_serve_args(sb.add_parser("serve", help="serve POST /run_code until interrupted (rlhf/sandbox/)"))
    rt = sub.add_parser("retrieval", help="local BM25 retrieval (verl's search tool's /retrieve)").add_subparsers(
        dest="retrieval_command", required=True)
    from rlhf.agent.search import add_serve_args as add_retrieval_args

    add_retrieval_args(rt.add_parser("serve", help="serve POST /retrieve until interrupted (rlhf/agent/search.py)"))
    return p


def _abs(path: Optional[str]) -> Optional[str]:
    """Existing local paths become absolute (the Slurm job runs from the repository root)."""
    if path and "://" not in path and os.path.exists(path.split(".py:")[0] + (".py" if ".py:" in path else "")):
        return os.path.abspath(path)
    return path


def _simple_overrides(args) -> list[str]:
    """The tutorial's flags that map one-to-one onto config keys."""
    pairs = [("trainer.log_freq", args.logging_steps), ("trainer.save_freq", args.save_steps),
             ("actor.optim.lr", args.learning_rate), ("trainer.total_epochs", args.num_train_epochs),
             ("trainer.total_training_steps", args.max_steps), ("trainer.seed", args.seed),
             ("actor.ppo_micro_batch_size_per_gpu", args.per_device_train_batch_size),
             ("critic.ppo_micro_batch_size_per_gpu", args.per_device_train_batch_size)]
    return [f"{k}={v!r}" for k, v in pairs if v is not None]


def _processes(args, cfg) -> Optional[int]:
    """Trainer processes: --nproc, else trainer.n_gpus_per_node x trainer.nnodes, else (torchrun on this node)
    the GPUs here (1 without), less the GPUs of disaggregated engines (at least 1: the config check refuses a
    job that leaves the trainer none); None for --slurm when neither is given (the sbatch script decides)."""
    from rlhf.rollout.placement import engine_gpus

    if args.nproc:
        return args.nproc
    r = cfg.rollout
    engines = engine_gpus(r.mode, r.num_engines, r.tensor_model_parallel_size)
    gpus, nodes = cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes
    if gpus:
        return max(1, gpus * (nodes or 1) - engines)
    if args.slurm:
        return None
    import torch

    count = torch.cuda.device_count()
    return max(1, count - engines) if count else 1


def _batch_overrides(args, cfg, world: Optional[int]) -> tuple[list[str], list[str]]:
    """(overrides, problems) of --gradient_accumulation_steps and --num_rollout_samples in the config's units
    (prompts per step and per optimizer step: each prompt gets rollout.n responses).  A problem: a flag whose
    value does not split into whole prompts, or accumulation without a known number of processes."""
    out, problems, n = [], [], cfg.rollout.n
    if args.num_rollout_samples is not None:
        if args.num_rollout_samples % n:
            problems.append(f"--num_rollout_samples {args.num_rollout_samples} is not a multiple of rollout.n={n} "
                            f"(responses per prompt); use a multiple of {n}.")
        else:
            out.append(f"data.train_batch_size={args.num_rollout_samples // n}")
    if args.gradient_accumulation_steps is None:
        return out, problems
    mp = (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
          * cfg.parallel.get("context_parallel_size", 1))
    if world is None or world % mp:
        problems.append("--gradient_accumulation_steps needs the number of trainer processes, a multiple of tensor x "
                        f"context x pipeline parallel = {mp}: give --nproc (all nodes together) or "
                        "trainer.n_gpus_per_node=... trainer.nnodes=...")
        return out, problems
    micro, dp = cfg.actor.ppo_micro_batch_size_per_gpu, world // mp
    seqs = micro * args.gradient_accumulation_steps * dp
    if seqs % n:
        problems.append(f"per-device batch {micro} x accumulation {args.gradient_accumulation_steps} x data-parallel "
                        f"size {dp} = {seqs} sequences is not a whole number of prompts of rollout.n={n} responses; "
                        f"make it a multiple of {n}.")
    else:
        out += [f"actor.ppo_mini_batch_size={seqs // n}", f"critic.ppo_mini_batch_size={seqs // n}"]
    return out, problems


def launch_commands(args) -> tuple[list[str], dict]:
    """(argv, extra env) of the torchrun run, or of the sbatch submission with --slurm.  The full config
    validation (data and model files included) runs first.

    Raises:
        ConfigError: the config does not compose or validate, or flags that do not map (all problems at once).
        ValueError: a bad command line (not key=value overrides, several nodes without --slurm).
    """
    from rlhf.api import build_overrides
    from rlhf.config import ConfigValidationError, compose_config
    from rlhf.config.validate import config_problems

    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise ValueError(f"not key=value overrides: {bad}")
    overrides = build_overrides(args.algorithm, _abs(args.model_name_or_path), args.critic_model and
                                _abs(args.critic_model), _abs(args.reward_model), _abs(args.dataset_name),
                                _abs(args.val_dataset_name), args.output_dir and os.path.abspath(args.output_dir),
                                [*_simple_overrides(args), *args.overrides],
                                safety_reward_model=_abs(args.safety_reward_model),
                                safety_reward_weight=args.safety_reward_weight)
    recipe = args.recipe or (SLURM_RECIPES.get(args.algorithm or "ppo") if args.slurm else None)
    config = args.config and os.path.abspath(args.config)
    cfg = compose_config(overrides, recipe=recipe, config_file=config)
    world = _processes(args, cfg)
    extra, problems = _batch_overrides(args, cfg, world)
    if extra:
        overrides += extra
        cfg = compose_config(overrides, recipe=recipe, config_file=config)
    problems += config_problems(cfg, world_size=world, check_files=True)  # fail here, not on the cluster
    if problems:
        raise ConfigValidationError(problems)
    head = [f"--config={config}"] if config else []
    if args.slurm:
        return ["sbatch", f"recipes/{recipe}/run_slurm.sbatch", *head, *overrides], {}
    if (cfg.trainer.nnodes or 1) > 1:
        raise ValueError(f"trainer.nnodes={cfg.trainer.nnodes}: rlhf launch runs on this node; use --slurm for "
                         f"several nodes")
    import torch

    env = {} if torch.cuda.is_available() else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={world}", "-m", "rlhf.main", *head, *([f"recipe={args.recipe}"] if args.recipe else []),
            *overrides]
    return argv, env


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rlhf.config import ConfigError

    args = _parser().parse_args(argv)
    if args.command == "sandbox":
        import logging

        from rlhf.sandbox.server import serve_from_args

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return serve_from_args(args)
    if args.command == "retrieval":
        from rlhf.agent.search import serve_from_args as serve_retrieval

        return serve_retrieval(args)
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
