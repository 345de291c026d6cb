"""Training entry point.

    python -m rlhf.main recipe=NAME [key=value ...]
    torchrun --nproc_per_node=N -m rlhf.main recipe=NAME [key=value ...]
    srun ... python -m rlhf.main recipe=NAME [key=value ...]          (Slurm: one task per GPU)

Every rank runs :func:`main`: it composes the config (``rlhf.config.compose_config``: schema defaults <
``ppo_trainer.yaml`` < recipe < overrides), validates it, and calls ``rlhf.trainer.run(cfg)``.
A config problem (unknown key, bad value) is printed once (rank 0) as a short message and the process
exits with code 2, before torch or any process group is touched.

Options:
    -h, --help        usage and the available recipes
    --cfg             print the composed, resolved config as YAML and exit (0 if it validates, else 2)
    --recipe NAME     same as recipe=NAME
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

EXIT_OK = 0
EXIT_RUNTIME_ERROR = 1
EXIT_CONFIG_ERROR = 2

_PROG = "python -m rlhf.main"

USAGE = f"""usage: {_PROG} [--help] [--cfg] recipe=NAME [key=value ...]

Compose the training config (schema defaults < rlhf/config/ppo_trainer.yaml < recipe < key=value) and
train.  Overrides use Hydra syntax: trainer.total_training_steps=5, data.train_files=[a.jsonl,b.jsonl],
model.path=/ckpt/Qwen2-7B-Instruct.  Extra recipe directories: hydra.searchpath=[file:///abs/dir]
(recipes in <dir>/recipe/NAME.yaml).

options:
  -h, --help      show this message and the recipes
  --cfg           print the resolved config as YAML and exit
  --recipe NAME   same as recipe=NAME
"""


class UsageError(Exception):
    """Bad command line (not a config problem): unknown option, missing option value."""


def _launch_rank() -> int:
    """Global rank from torchrun (RANK) or Slurm (SLURM_PROCID); 0 for a single process."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    return 0


def _launch_world_size() -> Optional[int]:
    """Number of trainer processes when launched by torchrun or Slurm (same rules as
    ``rlhf.mcore.distributed.detect_launch_env``), else None (unknown: world-size checks are skipped)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return int(os.environ["SLURM_NTASKS"])
    return None


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Split ``argv`` into options (``help``, ``cfg``) and Hydra overrides (``recipe=NAME`` included).

    Raises:
        UsageError: an unknown ``-option`` or ``--recipe`` without a name.
    """
    opts = {"help": False, "cfg": False}
    overrides: list[str] = []
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            opts["help"] = True
        elif a in ("--cfg", "--cfg=job"):
            opts["cfg"] = True
        elif a == "--recipe":
            name = next(it, None)
            if name is None or name.startswith("-"):
                raise UsageError("--recipe needs a name, e.g. --recipe quickstart")
            overrides.append(f"recipe={name}")
        elif a.startswith("--recipe="):
            overrides.append("recipe=" + a.split("=", 1)[1])
        elif a.startswith("-") and not a.startswith("~"):
            raise UsageError(f"unknown option {a!r}")
        elif "=" not in a and not a.startswith("~"):
            raise UsageError(f"{a!r} is not a key=value override (did you mean recipe={a}?)")
        elif a.startswith("algorithm=") or a.startswith("+algorithm="):
            # shorthand for an algorithm preset, e.g. algorithm=dpo or algorithm=grpo (rlhf.api.ALGORITHMS);
            # expanded in place, so overrides after it still win
            from rlhf.api import ALGORITHMS

            name = a.split("=", 1)[1]
            if name not in ALGORITHMS:
                raise UsageError(f"algorithm={name!r} is not a preset; use one of {sorted(ALGORITHMS)} "
                                 f"(or set algorithm.name / algorithm.adv_estimator directly)")
            overrides.extend(ALGORITHMS[name])
        else:
            overrides.append(a)
    return opts, overrides


def _recipe_descriptions() -> list[tuple[str, str]]:
    """(name, first descriptive comment line) of each built-in recipe."""
    from pathlib import Path

    from rlhf.config.loader import list_recipes

    out = []
    rdir = Path(__file__).resolve().parent / "config" / "recipe"
    for name in list_recipes():
        desc = ""
        p = rdir / f"{name}.yaml"
        if p.is_file():
            for line in p.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line.startswith("#") and "@package" not in line and line.lstrip("# "):
                    desc = line.lstrip("# ")
                    desc = desc.split(":", 1)[1].strip() if desc.startswith(f"{name}:") else desc
                    break
        out.append((name, desc))
    return out


def help_text() -> str:
    """Usage plus the recipe list."""
    lines = [USAGE, "recipes:"]
    for name, desc in _recipe_descriptions():
        lines.append(f"  {name:<22} {desc}")
    lines.append("\nexample: python -m rlhf.main recipe=quickstart trainer.total_training_steps=5")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Compose + validate the config from ``argv`` (default ``sys.argv[1:]``) and run the trainer.

    Returns the process exit code: 0 success, 2 bad command line or config (message on stderr, rank 0
    only), 1 when ``rlhf.trainer`` is missing.  Exceptions from training propagate.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    rank0 = _launch_rank() == 0

    def err(msg: str) -> None:
        if rank0:
            print(msg, file=sys.stderr, flush=True)

    try:
        opts, overrides = parse_args(argv)
    except UsageError as e:
        err(f"{_PROG}: {e}\n\n{USAGE}")
        return EXIT_CONFIG_ERROR
    if opts["help"]:
        if rank0:
            print(help_text())
        return EXIT_OK

    from omegaconf import OmegaConf

    from rlhf.config.loader import ConfigError, compose_config, validate_config

    try:
        cfg = compose_config(overrides)
        if opts["cfg"] and rank0:
            print(OmegaConf.to_yaml(cfg), end="", flush=True)
        validate_config(cfg, world_size=_launch_world_size())
    except ConfigError as e:
        err(f"{_PROG}: config error\n{e}")
        return EXIT_CONFIG_ERROR
    if opts["cfg"]:
        return EXIT_OK

    try:
        from rlhf import trainer
    except ModuleNotFoundError as e:
        if e.name == "rlhf.trainer":
            err(f"{_PROG}: rlhf.trainer is not available in this checkout (config composed and validated).")
            return EXIT_RUNTIME_ERROR
        raise
    try:
        trainer.run(cfg)
    except ConfigError as e:
        err(f"{_PROG}: config error\n{e}")
        return EXIT_CONFIG_ERROR
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
