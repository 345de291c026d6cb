"""Training entry point: a Hydra app (``@hydra.main`` on rlhf/config/ppo_trainer.yaml).

    python -m rlhf.main recipe=NAME [algorithm=NAME] [key=value ...]   (starts this node's ranks: rlhf/launcher.py)
    torchrun --nproc_per_node=N -m rlhf.main recipe=NAME [key=value ...]
    srun ... python -m rlhf.main recipe=NAME [key=value ...]          (Slurm: one task per GPU)
    python -m rlhf.main -m recipe=quickstart trainer.seed=1,2          (Hydra's multirun: a process per job, in turn)

Hydra parses the command line (``--help``, ``--cfg``, ``-m``, ``--config-dir``, ``hydra.*`` overrides), composes
the config and writes ``.hydra/`` into the run directory (``hydra.run.dir``, default ``trainer.default_local_dir``).
Before Hydra starts, :func:`main` translates verl's keys and config files (one preprocessing step,
:func:`rlhf.config.compose.translate`) and composes and validates the config of every job
(:func:`rlhf.config.compose_config`, :func:`rlhf.config.validate_config`): a config problem is printed once (rank 0)
with the nearest valid keys, all problems together, and the process exits with code 2 before torch or any process
group is touched.  rlhf's own options: ``--plan-memory[=GIB]``, ``--print-launch[=GPUS]``, ``--config FILE``,
``--recipe NAME`` (``--help`` lists them with the recipes and the algorithm presets).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from rlhf.launch_env import LaunchEnv, launch_env
from rlhf.logging_setup import filter_known_warnings, setup_logging

EXIT_OK, EXIT_RUNTIME_ERROR, EXIT_CONFIG_ERROR = 0, 1, 2
PROG = "python -m rlhf.main"
MODULE_DIR = Path(__file__).resolve().parent
#: options whose value may be left out: a bare --cfg is --cfg job (argparse would take the next override as value)
_BARE = {"--cfg": "--cfg=job", "-c": "--cfg=job", "--plan-memory": "--plan-memory=auto",
         "--print-launch": "--print-launch=auto"}
#: names a ``defaults:`` list or ``--config-name`` may use for the base config (ours and verl's)
BASE_NAMES = ("ppo_trainer", "ppo_megatron_trainer")


class UsageError(Exception):
    """Bad command line (not a config problem): unknown option, missing option value, unknown preset."""


def _parser():
    """Hydra's own argument parser (what ``@hydra.main`` parses with) plus rlhf's options, raising UsageError."""
    from hydra._internal.utils import get_args_parser

    p = get_args_parser()
    p.prog = PROG
    for option in ("--plan-memory", "--print-launch", "--config"):
        p.add_argument(option)
    p.add_argument("--recipe", action="append", default=[])

    def error(message: str):
        if m := re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message):
            message = f"{m[1]} needs a value, e.g. {m[1]} {'quickstart' if m[1] == '--recipe' else 'VALUE'}"
        raise UsageError(message)

    p.error = error
    return p


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Split ``argv`` into options and overrides (``recipe=NAME`` / ``algorithm=NAME`` included) with Hydra's parser:
    ``help``, ``cfg`` (a bool), ``config_file`` (``--config`` or ``--config-path``/``--config-name``, None for the
    base config) with ``config_note`` (the line saying which folder and file), ``config_dirs``, and when given
    ``plan_memory`` / ``print_launch`` and ``hydra`` (the options
    handed on to Hydra: ``--cfg``, ``-m``, ``--config-dir``, ...).

    Raises:
        UsageError: an unknown option, an option without its value, an argument that is not key=value, an unknown
            algorithm preset, or a config file that does not exist.
    """
    from rlhf.config import list_algorithms

    argv = list(argv)
    argv = [_BARE.get(a, a) if not (a in ("--cfg", "-c") and argv[i + 1:i + 2] and argv[i + 1] in
                                    ("job", "hydra", "all")) else a for i, a in enumerate(argv)]
    args, unknown = _parser().parse_known_intermixed_args(argv)  # options and overrides in any order
    if unknown:
        from rlhf.resume import RESUME_HINT, is_resume_option

        bad = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise UsageError(f"unknown option {bad!r}" + (f"; {RESUME_HINT}" if is_resume_option(bad) else ""))
    if args.print_launch not in (None, "auto") and not args.print_launch.isdigit():
        raise UsageError(f"--print-launch={args.print_launch}: give this node's GPU count, e.g. --print-launch=8")
    overrides = [f"recipe={name}" for name in args.recipe]
    for a in args.overrides:
        if "=" not in a and not a.startswith("~"):
            raise UsageError(f"{a!r} is not a key=value override (did you mean recipe={a}?)")
        if a.startswith(("algorithm=", "+algorithm=")) and a.split("=", 1)[1] not in list_algorithms():
            raise UsageError(f"algorithm={a.split('=', 1)[1]!r} is not a preset; use one of {list_algorithms()} "
                             f"(or set algorithm.name / algorithm.adv_estimator directly)")
        overrides.append(a.lstrip("+") if a.startswith(("+algorithm=", "+recipe=")) else a)
    # Hydra's own options, handed on to it; --cfg job / all prints the config resolved, as before (Hydra's --resolve)
    hydra = [flag for flag, on in (("--help", args.help), ("--hydra-help", args.hydra_help), ("-m", args.multirun),
                                   ("--shell-completion", args.shell_completion), ("--resolve", args.resolve or (
                                       args.cfg not in (None, "hydra")))) if on]
    hydra += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if v and k in (
        "cfg", "package", "info", "config_dir", "experimental_rerun")]
    opts = {"help": args.help, "cfg": args.cfg is not None, "config_file": _config_file(args),
            "config_dirs": [args.config_dir] if args.config_dir else []}
    if opts["config_file"] is not None:  # which config folder this run loads: one line, also at --cfg
        opts["config_note"] = describe_config_file(opts["config_file"], args.config_path if args.config_name else None)
    opts.update({k: v for k, v in (("plan_memory", args.plan_memory), ("hydra", hydra)) if v})
    if args.print_launch is not None:
        opts["print_launch"] = int(args.print_launch) if args.print_launch.isdigit() else "auto"
    return opts, overrides


def _config_file(args) -> Optional[Path]:
    """The file of ``--config`` or ``--config-path``/``--config-name`` (verl's: its base names without a file of
    theirs are verl's defaults for them, rlhf/config/verl/), None for neither."""
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
    return find_config_file(args.config_path, args.config_name)


def find_config_file(config_path: Optional[str], config_name: str) -> Path:
    """The file ``--config-path``/``--config-name`` name: ``config_path`` relative to the working directory, then
    (as Hydra does) to rlhf/; for verl's base names (:data:`BASE_NAMES`) then in a verl checkout
    (``verl/trainer/<config_path>``), else verl's defaults for that name (rlhf/config/verl/), so verl's
    ``--config-path=config --config-name=ppo_megatron_trainer`` gets verl's values anywhere.  Raises UsageError:
    no such file (a name other than verl's base names)."""
    from rlhf.config.config_file import VERL_DEFAULTS

    name = config_name.removesuffix(".yaml")
    relative = bool(config_path) and not os.path.isabs(config_path)
    dirs = [Path(config_path or ".")] + ([MODULE_DIR / config_path] if relative else [])
    if name in BASE_NAMES and relative:
        dirs.append(Path("verl") / "trainer" / config_path)  # the working directory is a verl checkout
    for p in (d / f"{name}.yaml" for d in dirs):
        if p.is_file() and (p.resolve().parent != MODULE_DIR / "config" or name not in BASE_NAMES):
            return p
    if name in BASE_NAMES:
        return VERL_DEFAULTS / f"{name}.yaml"
    raise UsageError(f"--config-name={config_name}: no such config file (looked for "
                     f"{', '.join(str(d / f'{name}.yaml') for d in dirs)}); give --config-path=<directory of the "
                     f"file> or --config=<file>.")


def describe_config_file(path: Path, config_path: Optional[str] = None) -> str:
    """One line saying which config folder and file a run loaded (printed, also at ``--cfg``)."""
    from rlhf.config.config_file import VERL_DEFAULTS

    path = Path(path)
    if path.resolve().parent == VERL_DEFAULTS:
        looked = f"no {Path(config_path or '.') / path.name} in {Path.cwd()}; " if config_path is not None else ""
        return (f"config: {looked}verl's defaults for --config-name={path.stem} ({path.resolve()}: verl's values "
                f"where they differ from ours, e.g. bf16, weight decay 0.01) over rlhf's base config")
    return f"config: folder {path.resolve().parent}, file {path.name} (over rlhf's base config)"


def _jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The overrides of each job: one, or Hydra's sweep of ``-m`` (``a=1,2 b=x,y``: four jobs)."""
    if not multirun:
        return [overrides]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Check the config of ``argv`` (default ``sys.argv[1:]``), then run it as the Hydra app (or start this node's
    ranks, each running this).

    Returns the process exit code: 0 success, 2 bad command line or config (message on stderr, rank 0 only), 1 when
    ``rlhf.trainer`` is missing or training failed (Hydra prints the error).
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
        err(f"{PROG}: {e}\n(see {PROG} --help)")
        return EXIT_CONFIG_ERROR
    except SystemExit as e:  # --version
        return e.code or EXIT_OK
    from rlhf.config import ConfigError, compose_config
    from rlhf.config.compose import translate

    if opts.get("config_note"):
        err(f"{PROG}: {opts['config_note']}")
    hydra, cfg, t = opts.get("hydra", []), None, None
    try:
        t = translate(overrides, opts["config_file"])
        if not (opts["help"] or {"--hydra-help", "--shell-completion"} & set(hydra) or any(
                h.startswith(("--info", "--cfg=hydra")) for h in hydra)):
            for job in _jobs(overrides, "-m" in hydra):
                cfg = compose_config(job, config_file=opts["config_file"], search_paths=opts["config_dirs"],
                                     check_files=True)  # a config error names the model / layout problems too
                if "print_launch" in opts or "plan_memory" in opts:
                    return _print_launch(cfg, opts["print_launch"]) if "print_launch" in opts else \
                        _plan_memory(cfg, opts["plan_memory"], err)
                _validate(cfg, env, run=not opts["cfg"])
    except ConfigError as e:
        from rlhf.config.verl.words import in_user_words

        err(f"{PROG}: config error\n{in_user_words(str(e), t)}")  # verl's keys where the user wrote them
        return EXIT_CONFIG_ERROR
    if opts["cfg"] and env.rank != 0:
        return EXIT_OK  # one rank prints
    verl = cfg is not None and t.speaks_verl and not any(o.startswith("rollout.num_engines=") for o in t.overrides)
    extra = [f"rollout.num_engines={cfg.rollout.num_engines}"] if verl else []  # verl's replica count, as checked
    extra += [] if env.rank == 0 else ["hydra.output_subdir=null"]  # rank 0 writes .hydra/
    return _run_hydra([*hydra, *t.overrides, *extra], argv, opts["config_dirs"], env)


def _validate(cfg, env: LaunchEnv, run: bool) -> None:
    """validate_config with this job's trainer processes: a run also checks the placement on this machine's GPUs
    (before any model is built); ``--cfg`` stays torch-free."""
    from rlhf.config import validate_config
    from rlhf.launcher import _cuda_count, plan_launch

    node = plan_launch(cfg, env) if run else None
    pools = bool(cfg.rollout.get("n_gpus_per_node"))  # verl's pools: trainer.n_gpus_per_node is not a node's size
    gpus = None if not run or (cfg.trainer.n_gpus_per_node and not pools) else (_cuda_count() or None)
    validate_config(cfg, world_size=node.world_size if node else env.world_size, check_files=True,
                    gpus_per_node=gpus)
    if run and (cfg.model.moe_token_dispatcher_type == "flex" or cfg.model.moe_enable_deepep):
        from parallel.preflight import check_token_dispatcher
        from rlhf.config import ConfigValidationError

        problems = check_token_dispatcher(cfg.model.moe_token_dispatcher_type, cfg.model.moe_enable_deepep,
                                          "cuda" if _cuda_count() else "cpu")
        if problems:  # DeepEP: CUDA and the deep_ep package, before any model is built
            raise ConfigValidationError(problems)
    if run and (cfg.trainer.one_step_off_policy.enable or cfg.async_training.enable) and \
            cfg.rollout.mode == "colocated" and _cuda_count():
        from rlhf.config import ConfigValidationError

        key = "trainer.one_step_off_policy" if cfg.trainer.one_step_off_policy.enable else "async_training"
        raise ConfigValidationError([ONE_STEP_OFF_ON_SHARED_GPUS.format(key=key)])


#: one step off-policy and fully async keep colocated engines resident while the actor trains: fine on CPU, not
#: planned on GPUs ({key}: the mode's key)
ONE_STEP_OFF_ON_SHARED_GPUS = (
    "{key}.enable=true with colocated engines on GPUs: the engines would keep their weights "
    "and KV cache on the trainer's GPUs while the actor trains (nothing is released between steps), which the "
    "memory plan does not count; verl's one-step-off and fully async trainers refuse it too (hybrid_engine must be "
    "False). Give the "
    "rollout GPUs of its own: actor_rollout_ref.hybrid_engine=False with rollout.nnodes / rollout.n_gpus_per_node "
    "(verl's pool keys), or rollout.mode=disaggregated.")


def _run_hydra(hydra_argv: list[str], argv: list[str], config_dirs: list[str], env: LaunchEnv) -> int:
    """Run the ``@hydra.main`` app on ``hydra_argv`` (Hydra reads ``sys.argv``); the job's exit code."""
    import hydra
    from omegaconf import OmegaConf

    from rlhf.config import register_configs

    started = []

    def job(cfg) -> None:
        started.append(True)
        _job(cfg, argv, config_dirs, env)

    register_configs()
    if not OmegaConf.has_resolver("rlhf.options"):  # --help's listing of the recipes / presets (ppo_trainer.yaml)
        OmegaConf.register_new_resolver("rlhf.options", lambda group: "\n".join(
            f"  {name:<28} {desc}" for name, desc in describe_options(group)))
    app = hydra.main(config_path="pkg://rlhf.config", config_name="ppo_trainer", version_base="1.3")(job)
    saved, sys.argv = sys.argv, [sys.argv[0] if sys.argv else PROG, *hydra_argv]
    try:
        app()
    except SystemExit as e:  # the job's exit code, or Hydra's (1: an error in the job, printed by Hydra)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except Exception as e:  # noqa: BLE001 - before any job: Hydra's command-line checks (--cfg with -m, --help ...)
        if started:  # HYDRA_FULL_ERROR=1: the job's own error, as raised
            raise
        print(f"{PROG}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:
        sys.argv = saved
    return EXIT_OK


def describe_options(group: str) -> list[tuple[str, str]]:
    """(name, the first descriptive comment line of its file) of each built-in recipe / algorithm preset."""
    from rlhf.config.compose import CONFIG_DIR, RECIPE_GROUP, list_options, recipe_files

    out = []
    for name in list_options(group, ()):
        path = recipe_files()[name] if group == RECIPE_GROUP else CONFIG_DIR / group / f"{name}.yaml"
        desc = next((ln.strip().lstrip("# ") for ln in path.read_text(encoding="utf-8").splitlines() if
                     ln.strip().startswith("#") and "@package" not in ln and ln.strip().lstrip("# ")), "")
        out.append((name, desc.split(":", 1)[1].strip() if desc.startswith(f"{name}:") else desc))
    return out


def _job(cfg, argv: list[str], config_dirs: list[str], env: LaunchEnv) -> None:
    """Hydra's task: a multirun job runs as ``python -m rlhf.main`` of its own (a fresh process: Ray, process group,
    devices) in ``<trainer.default_local_dir>/<job number>``; a run starts this node's ranks (each runs
    ``python -m rlhf.main argv``) or trains as one rank.  A non-zero exit code leaves as SystemExit."""
    import subprocess

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from rlhf.config import ConfigError
    from rlhf.launcher import plan_launch, run_node

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        searchpath = [o for o in hc.overrides.hydra if o.startswith("hydra.searchpath=")]
        code = subprocess.call([sys.executable, "-m", "rlhf.main", *(f"--config-dir={d}" for d in config_dirs),
                                *hc.overrides.task, *searchpath, f"trainer.default_local_dir={hc.runtime.output_dir}"])
        if code:
            raise SystemExit(code)  # the sweep stops at a failed job
        return
    OmegaConf.resolve(cfg)
    node = plan_launch(cfg, env)
    if node is not None:
        code = run_node(node, argv)
        if code:
            raise SystemExit(code)
        return
    try:
        from rlhf import trainer
        from rlhf.config.objects import write_run_config
    except ModuleNotFoundError as e:
        if e.name != "rlhf.trainer":
            raise
        print(f"{PROG}: rlhf.trainer is not available in this checkout (config composed and validated).",
              file=sys.stderr)
        raise SystemExit(EXIT_RUNTIME_ERROR) from None
    setup_logging(env.rank)
    if env.rank == 0:
        write_run_config(cfg)  # <trainer.default_local_dir>/config.yaml, resolved (checkpoint conversion reads it)
    try:
        trainer.run(cfg)
    except ConfigError as e:
        if env.rank == 0:
            print(f"{PROG}: config error\n{e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None


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
    """``--plan-memory``: the per-GPU memory plan of ``cfg`` on GPUs of ``gib`` GiB ("auto": this machine's)."""
    from rlhf.config import validate_config
    from rlhf.memory_plan.cli import plan_memory_report, planned_gpus

    # the placement on the GPUs the plan assumes (verl's pools: trainer.* is not a node's size; checked at the start)
    validate_config(cfg, gpus_per_node=None if cfg.rollout.get("n_gpus_per_node") else planned_gpus(cfg)[0])
    try:
        code, text = plan_memory_report(cfg, None if gib == "auto" else float(gib))
    except ValueError:
        code, text = EXIT_CONFIG_ERROR, f"--plan-memory={gib}: give the GPU size in GiB, e.g. --plan-memory=80"
    if text.startswith(("cannot plan", "--plan-memory")):
        err(f"{PROG}: {text}")
    else:
        print(text, flush=True)  # the table, also when it does not fit (exit 2)
    return code


if __name__ == "__main__":
    sys.exit(main())
