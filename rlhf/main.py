"""Training entry point.

    python -m rlhf.main recipe=NAME [algorithm=NAME] [key=value ...]   (starts this node's ranks: rlhf/launcher.py)
    torchrun --nproc_per_node=N -m rlhf.main recipe=NAME [key=value ...]
    srun ... python -m rlhf.main recipe=NAME [key=value ...]          (Slurm: one task per GPU)

Every rank runs :func:`main`: it composes the config (:func:`rlhf.config.compose_config`), validates it and
calls ``rlhf.trainer.run(cfg)``.  A config problem (unknown key, bad value) is printed once (rank 0) as a
short message and the process exits with code 2, before torch or any process group is touched.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from rlhf.launch_env import launch_env
from rlhf.logging_setup import filter_known_warnings, setup_logging

EXIT_OK, EXIT_RUNTIME_ERROR, EXIT_CONFIG_ERROR = 0, 1, 2
_PROG = "python -m rlhf.main"
MODULE_DIR = Path(__file__).resolve().parent
USAGE = f"""usage: {_PROG} [--help] [--cfg [job]] [--config FILE | --config-path DIR --config-name NAME]
                          [recipe=NAME] [algorithm=NAME] [key=value ...]

Compose the training config (schema defaults < rlhf/config/ppo_trainer.yaml < recipe < algorithm preset
< config file < key=value) and train.  Overrides use Hydra syntax: trainer.total_training_steps=5,
data.train_files=[a.jsonl,b.jsonl], model.path=/ckpt/Qwen2-7B-Instruct.  verl's keys work too
(actor_rollout_ref.actor.optim.lr=1e-6, critic.model.path=..., trainer.n_gpus_per_node=8); settings with no
equivalent here are all named in one error.  Extra recipe directories: hydra.searchpath=[file:///abs/dir]
(recipes in <dir>/recipe/NAME.yaml).  hydra.run.dir=DIR: the run directory (trainer.default_local_dir unless
that is given too; the composed config is written to DIR/.hydra/).

options:
  -h, --help            show this message, the recipes and the algorithm presets
  --cfg [job], -c job   print the resolved config as YAML, check it (data and model paths included) and exit
  --plan-memory[=GIB]   print the per-GPU memory plan (rlhf/memory_plan/cli.py) and exit: 0 fits, 2 not
  --print-launch[=GPUS] print "RANKS ENGINE_GPUS" and exit: the trainer ranks to start on a node of GPUS GPUs
                        (default this machine's) and the GPUs the disaggregated engines keep (0 colocated);
                        exit 2 when no GPU is left for the trainer (recipes/_launch/*.sh use it)
  --config FILE         a YAML file of settings, verl's layout or ours (the command line wins over it)
  --config-path DIR, -cp DIR, --config-name NAME, -cn NAME
                        the same as --config DIR/NAME.yaml (Hydra's options; DIR relative to the working
                        directory or to rlhf/); NAME ppo_trainer or ppo_megatron_trainer alone is the base config
  --config-dir DIR, -cd DIR
                        an extra directory of recipes (recipe/NAME.yaml)
  --recipe NAME         same as recipe=NAME
  --resolve             accepted (the printed config is always resolved)
  -m, --multirun        not supported: run one job per setting
"""
_CFG_CHOICES = ("job", "hydra", "all")
#: options whose value is optional and then given only after "=" (argparse would take the next override)
_BARE = {"--cfg": "--cfg=job", "-c": "--cfg=job", "--plan-memory": "--plan-memory=auto",
         "--print-launch": "--print-launch=auto"}


class UsageError(Exception):
    """Bad command line (not a config problem): unknown option, missing option value, unknown preset."""


class _Parser(argparse.ArgumentParser):
    """argparse raising :class:`UsageError` (main prints it once, on rank 0) instead of exiting."""

    def error(self, message: str):
        m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if m:
            message = f"{m[1]} needs a value, e.g. {m[1]} {'quickstart' if m[1] == '--recipe' else 'VALUE'}"
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    """Hydra's options (hydra._internal.utils.get_args_parser) that apply to one composed job, and ours."""
    p = _Parser(prog=_PROG, add_help=False, allow_abbrev=False)
    p.add_argument("--help", "-h", action="store_true")
    p.add_argument("--cfg", "-c", choices=_CFG_CHOICES)
    p.add_argument("--resolve", "--run", "-r", action="store_true")  # accepted: the printed config is resolved
    p.add_argument("--multirun", "-m", action="store_true")
    p.add_argument("--plan-memory")
    p.add_argument("--print-launch")
    p.add_argument("--config")
    p.add_argument("--config-path", "-cp")
    p.add_argument("--config-name", "-cn")
    p.add_argument("--config-dir", "-cd", action="append", default=[])
    p.add_argument("--recipe", action="append", default=[])
    p.add_argument("overrides", nargs="*")
    return p


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Split ``argv`` into options (``help``, ``cfg``, ``config_file``, ``config_dirs``, and ``plan_memory`` /
    ``print_launch`` when given) and Hydra overrides (``recipe=NAME`` and ``algorithm=NAME`` included).

    Raises:
        UsageError: an unknown ``-option``, an option without its value, ``--cfg hydra``, ``-m`` (multirun),
            an unknown algorithm preset, or a ``--config-name`` file that does not exist.
    """
    from rlhf.config import list_algorithms

    argv = list(argv)
    for i, a in enumerate(argv):  # a bare --cfg (not before job/hydra/all), --plan-memory or --print-launch
        after = argv[i + 1] if i + 1 < len(argv) else None
        if a in _BARE and not (a in ("--cfg", "-c") and after in _CFG_CHOICES):
            argv[i] = _BARE[a]
    args, unknown = _parser().parse_known_intermixed_args(argv)
    if unknown:
        from rlhf.config.resume import RESUME_HINT, is_resume_option

        bad = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise UsageError(f"unknown option {bad!r}" + (f"; {RESUME_HINT}" if is_resume_option(bad) else ""))
    if args.multirun:
        raise UsageError("multirun (-m) sweeps are not supported: start one job per setting (a shell loop, or a "
                         "Slurm job array) with single key=value overrides")
    if args.cfg == "hydra":
        raise UsageError("--cfg hydra: there is no Hydra runtime config here (rlhf composes with Hydra's "
                         "compose API); use --cfg job")
    if args.print_launch not in (None, "auto", "") and not args.print_launch.isdigit():
        raise UsageError(f"--print-launch={args.print_launch}: give this node's GPU count, e.g. --print-launch=8")
    overrides = [f"recipe={name}" for name in args.recipe]
    for a in args.overrides:
        if "=" not in a and not a.startswith("~"):
            raise UsageError(f"{a!r} is not a key=value override (did you mean recipe={a}?)")
        if a.startswith(("algorithm=", "+algorithm=")):  # the preset algorithm/<NAME>.yaml
            name, presets = a.split("=", 1)[1], list_algorithms()
            if name not in presets:
                raise UsageError(f"algorithm={name!r} is not a preset; use one of {presets} "
                                 f"(or set algorithm.name / algorithm.adv_estimator directly)")
            a = f"algorithm={name}"
        overrides.append(a)
    opts = {"help": args.help, "cfg": args.cfg is not None, "config_file": _config_file(args),
            "config_dirs": args.config_dir}
    if args.plan_memory is not None:
        opts["plan_memory"] = args.plan_memory or "auto"
    if args.print_launch is not None:
        opts["print_launch"] = int(args.print_launch) if args.print_launch.isdigit() else "auto"
    return opts, overrides


def _config_file(args: argparse.Namespace) -> Optional[Path]:
    from rlhf.config import ConfigError
    from rlhf.config.config_file import find_config_file

    if args.config is not None and (args.config_name is not None or args.config_path is not None):
        raise UsageError("give either --config FILE or --config-path/--config-name, not both")
    if args.config is not None:
        if not Path(args.config).is_file():
            raise UsageError(f"--config {args.config}: no such file")
        return Path(args.config)
    if args.config_name is None:
        if args.config_path is not None:
            raise UsageError("--config-path needs --config-name NAME (the file NAME.yaml in that directory)")
        return None
    try:
        return find_config_file(args.config_path, args.config_name, MODULE_DIR)
    except ConfigError as e:
        raise UsageError(str(e)) from None


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
    filter_known_warnings()  # before any library is imported: most of these warnings come at import time

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
        cfg = compose_config(overrides, config_file=opts["config_file"], search_paths=opts["config_dirs"],
                             check_files=True)  # a config error names the model / layout problems too
        if opts.get("print_launch") is not None:
            return _print_launch(cfg, opts["print_launch"])
        if opts.get("plan_memory"):
            return _plan_memory(cfg, opts["plan_memory"], err)
        if opts["cfg"] and env.rank == 0:
            print(OmegaConf.to_yaml(cfg), end="", flush=True)
        from rlhf.launcher import _cuda_count, plan_launch, run_node  # one command per node: start the local ranks

        node = None if opts["cfg"] else plan_launch(cfg, env)
        # a run checks the placement on this machine's GPUs too (before any model is built); --cfg stays torch-free
        gpus = None if opts["cfg"] or cfg.trainer.n_gpus_per_node else (_cuda_count() or None)
        validate_config(cfg, world_size=node.world_size if node else env.world_size, check_files=True,
                        gpus_per_node=gpus)
        if opts["cfg"]:
            return EXIT_OK
        if node is not None:
            return run_node(node, argv)
        try:
            from rlhf import trainer
            from rlhf.config.run_config import write_run_config
        except ModuleNotFoundError as e:
            if e.name != "rlhf.trainer":
                raise
            err(f"{_PROG}: rlhf.trainer is not available in this checkout (config composed and validated).")
            return EXIT_RUNTIME_ERROR
        setup_logging(env.rank)
        if env.rank == 0:
            write_run_dir(cfg, argv)
            write_run_config(cfg)
        trainer.run(cfg)
    except ConfigError as e:
        err(f"{_PROG}: config error\n{e}")
        return EXIT_CONFIG_ERROR
    return EXIT_OK


def _print_launch(cfg, gpus) -> int:
    """``--print-launch``: "RANKS ENGINE_GPUS" of one node of ``gpus`` GPUs ("auto": this machine's); a
    LaunchConfigError (no GPU left for the trainer) propagates to main's config-error exit."""
    from rlhf.launcher import local_ranks
    from rlhf.rollout.placement import engine_gpus

    r = cfg.rollout
    ranks = local_ranks(cfg, None if gpus == "auto" else gpus)
    print(ranks, engine_gpus(r.mode, r.num_engines, r.tensor_model_parallel_size), flush=True)
    return EXIT_OK


def _plan_memory(cfg, gib: str, err) -> int:
    from rlhf.config import validate_config
    from rlhf.memory_plan.cli import plan_memory_report, planned_gpus

    validate_config(cfg, gpus_per_node=planned_gpus(cfg)[0])  # the placement on the GPUs the plan assumes
    try:
        code, text = plan_memory_report(cfg, None if gib == "auto" else float(gib))
    except ValueError:
        code, text = EXIT_CONFIG_ERROR, f"--plan-memory={gib}: give the GPU size in GiB, e.g. --plan-memory=80"
    if text.startswith(("cannot plan", "--plan-memory")):
        err(f"{_PROG}: {text}")
    else:
        print(text, flush=True)  # the table, also when it does not fit (exit 2)
    return code


def write_run_dir(cfg, argv: Sequence[str]) -> Optional[Path]:
    """With ``hydra.run.dir=DIR`` on the command line, write what Hydra apps write there: ``DIR/.hydra/config.yaml``
    (the composed config) and ``DIR/.hydra/overrides.yaml`` (the command line).  Returns DIR or None."""
    from omegaconf import OmegaConf

    raw = next((a.split("=", 1)[1] for a in reversed(list(argv)) if a.lstrip("+").startswith("hydra.run.dir=")), None)
    if raw is None:
        return None
    run_dir = Path(OmegaConf.create({**OmegaConf.to_container(cfg), "_run_dir": raw})._run_dir)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(argv))),
                                                        encoding="utf-8")
    return run_dir


if __name__ == "__main__":
    sys.exit(main())
