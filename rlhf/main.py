"""Training entry point.

    python -m rlhf.main recipe=NAME [algorithm=NAME] [key=value ...]
    torchrun --nproc_per_node=N -m rlhf.main recipe=NAME [key=value ...]
    srun ... python -m rlhf.main recipe=NAME [key=value ...]          (Slurm: one task per GPU)

Every rank runs :func:`main`: it composes the config (:func:`rlhf.config.compose_config`), validates it and
calls ``rlhf.trainer.run(cfg)``.  A config problem (unknown key, bad value) is printed once (rank 0) as a
short message and the process exits with code 2, before torch or any process group is touched.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from rlhf.launch_env import launch_env

EXIT_OK, EXIT_RUNTIME_ERROR, EXIT_CONFIG_ERROR = 0, 1, 2
_PROG = "python -m rlhf.main"
USAGE = f"""usage: {_PROG} [--help] [--cfg] recipe=NAME [algorithm=NAME] [key=value ...]

Compose the training config (schema defaults < rlhf/config/ppo_trainer.yaml < recipe < algorithm preset
< key=value) and train.  Overrides use Hydra syntax: trainer.total_training_steps=5,
data.train_files=[a.jsonl,b.jsonl], model.path=/ckpt/Qwen2-7B-Instruct.  Extra recipe directories:
hydra.searchpath=[file:///abs/dir] (recipes in <dir>/recipe/NAME.yaml).

options:
  -h, --help      show this message, the recipes and the algorithm presets
  --cfg           print the resolved config as YAML and exit
  --recipe NAME   same as recipe=NAME
"""


class UsageError(Exception):
    """Bad command line (not a config problem): unknown option, missing option value, unknown preset."""


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Split ``argv`` into options (``help``, ``cfg``) and Hydra overrides (``recipe=NAME`` and
    ``algorithm=NAME`` included).

    Raises:
        UsageError: an unknown ``-option``, ``--recipe`` without a name, or an unknown algorithm preset.
    """
    from rlhf.config import list_algorithms

    opts, overrides, it = {"help": False, "cfg": False}, [], iter(argv)
    for a in it:
        if a in ("-h", "--help", "--cfg", "--cfg=job"):
            opts["help" if a in ("-h", "--help") else "cfg"] = True
        elif a == "--recipe" or a.startswith("--recipe="):
            name = a.split("=", 1)[1] if "=" in a else next(it, None)
            if name is None or name.startswith("-"):
                raise UsageError("--recipe needs a name, e.g. --recipe quickstart")
            overrides.append(f"recipe={name}")
        elif a.startswith("-") and not a.startswith("~"):
            raise UsageError(f"unknown option {a!r}")
        elif "=" not in a and not a.startswith("~"):
            raise UsageError(f"{a!r} is not a key=value override (did you mean recipe={a}?)")
        elif a.startswith(("algorithm=", "+algorithm=")):  # the preset algorithm/<NAME>.yaml
            name, presets = a.split("=", 1)[1], list_algorithms()
            if name not in presets:
                raise UsageError(f"algorithm={name!r} is not a preset; use one of {presets} "
                                 f"(or set algorithm.name / algorithm.adv_estimator directly)")
            overrides.append(f"algorithm={name}")
        else:
            overrides.append(a)
    return opts, overrides


def help_text() -> str:
    """Usage plus the recipes and the algorithm presets."""
    from rlhf.config.compose import describe_options

    lines = [USAGE]
    for group, title in (("recipe", "recipes"), ("algorithm", "algorithm presets (algorithm=NAME)")):
        lines += [f"{title}:"] + [f"  {name:<28} {desc}" for name, desc in describe_options(group)] + [""]
    return "\n".join(lines + ["example: python -m rlhf.main recipe=quickstart trainer.total_training_steps=5"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Compose + validate the config from ``argv`` (default ``sys.argv[1:]``) and run the trainer.

    Returns the process exit code: 0 success, 2 bad command line or config (message on stderr, rank 0
    only), 1 when ``rlhf.trainer`` is missing.  Exceptions from training propagate.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    env = launch_env()

    def err(msg: str) -> None:
        if env.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    try:
        opts, overrides = parse_args(argv)
    except UsageError as e:
        err(f"{_PROG}: {e}\n\n{USAGE}")
        return EXIT_CONFIG_ERROR
    if opts["help"]:
        if env.rank == 0:
            print(help_text())
        return EXIT_OK

    from omegaconf import OmegaConf

    from rlhf.config import ConfigError, compose_config, validate_config

    try:
        cfg = compose_config(overrides)
        if opts["cfg"] and env.rank == 0:
            print(OmegaConf.to_yaml(cfg), end="", flush=True)
        validate_config(cfg, world_size=env.world_size)
        if opts["cfg"]:
            return EXIT_OK
        try:
            from rlhf import trainer
        except ModuleNotFoundError as e:
            if e.name != "rlhf.trainer":
                raise
            err(f"{_PROG}: rlhf.trainer is not available in this checkout (config composed and validated).")
            return EXIT_RUNTIME_ERROR
        trainer.run(cfg)
    except ConfigError as e:
        err(f"{_PROG}: config error\n{e}")
        return EXIT_CONFIG_ERROR
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
