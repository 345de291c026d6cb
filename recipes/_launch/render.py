"""Writes every recipe's ``run_torchrun.sh`` and ``run_slurm.sbatch`` from the two templates below.

A recipe's launch scripts differ only by its name, its one-line description (line 2 of
``recipes/<name>/<name>.yaml``: ``# <name>: <description>``) and its resource profile, which is the one data
line each script keeps: ``RECIPE=<name> DEFAULT_NPROC=<n> DEVICE=cpu|gpu`` in ``run_torchrun.sh`` (read back
from the existing script, or given for a new recipe).  Everything else comes from here, and
tests/unit/test_launch_scripts.py checks that every script equals its rendering.

    python recipes/_launch/render.py                 # rewrite every recipe's scripts
    python recipes/_launch/render.py --check         # exit 1 naming the scripts that differ
    python recipes/_launch/render.py --new NAME --device gpu --nproc 8   # scripts for a new recipe
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1]

TORCHRUN = """#!/usr/bin/env bash
# {name}: {description}
#
# One machine, {ranks}: torchrun starts the ranks, each running `python -m rlhf.main recipe={name}`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/{name}/run_torchrun.sh {example}
#   NPROC=<n> bash recipes/{name}/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE={name} DEFAULT_NPROC={nproc} DEVICE={device}
source "$(dirname "${{BASH_SOURCE[0]}}")/../_launch/torchrun.sh"
"""

SLURM = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes=1
{resources}#SBATCH --output=%x-%j.out
#
# {name}: {description}
#
# Slurm: one srun step of trainer ranks ({tasks}),
# each running `python -m rlhf.main recipe={name}`; the step's first task on each node also runs that
# node's Ray (head on the first node) for the rollout engines.  Shared body: recipes/_launch/slurm_body.sh
# (ports from the job id, the Ray join check, logs).  Submit from the repository root; extra arguments are
# config overrides:
#   sbatch recipes/{name}/run_slurm.sbatch trainer.total_training_steps=10
#   sbatch --nodes=2 recipes/{name}/run_slurm.sbatch     # more data parallelism
RECIPE={name} DEVICE={device}{tasks_var}
BODY=${{REPO_DIR:-${{SLURM_SUBMIT_DIR:-$PWD}}}}/recipes/_launch/slurm_body.sh
[ -f "$BODY" ] || {{ echo "$BODY not found: submit from the repository root (or set REPO_DIR)" >&2; exit 2; }}
source "$BODY" "$@"
"""

PROFILE_LINE = re.compile(r"^RECIPE=(\S+) DEFAULT_NPROC=(\d+) DEVICE=(cpu|gpu)$", re.M)


@dataclass(frozen=True)
class Profile:
    """A recipe's resources: ``nproc`` ranks on one machine (CPU processes, or GPUs), on ``device``."""

    device: str
    nproc: int


def description(name: str) -> str:
    """The recipe's one-line description, from line 2 of its config (``# <name>: <description>``).

    Raises:
        ValueError: the config has no such line.
    """
    path = RECIPES / name / f"{name}.yaml"
    lines = path.read_text(encoding="utf-8").splitlines()
    head = f"# {name}: "
    for line in lines[:3]:
        if line.startswith(head):
            return line[len(head):].strip()
    raise ValueError(f"{path}: line 2 must read '# {name}: <one-line description>' (the launch scripts use it)")


def profile_of(name: str) -> Profile:
    """The profile kept in ``recipes/<name>/run_torchrun.sh``'s data line.

    Raises:
        ValueError: the script is missing or has no ``RECIPE=<name> DEFAULT_NPROC=<n> DEVICE=cpu|gpu`` line.
    """
    path = RECIPES / name / "run_torchrun.sh"
    m = PROFILE_LINE.search(path.read_text(encoding="utf-8")) if path.is_file() else None
    if not m or m.group(1) != name:
        raise ValueError(f"{path}: no line 'RECIPE={name} DEFAULT_NPROC=<n> DEVICE=cpu|gpu'; create the scripts "
                         f"with: python recipes/_launch/render.py --new {name} --device cpu|gpu --nproc N")
    return Profile(m.group(3), int(m.group(2)))


def render(name: str, prof: Profile) -> dict[str, str]:
    """``{"run_torchrun.sh": text, "run_slurm.sbatch": text}`` of recipe ``name``."""
    desc = description(name)
    n = prof.nproc
    if prof.device == "gpu":
        ranks, example = f"{n} GPUs", "model.path=<local copy of the model>"
        resources = (f"#SBATCH --ntasks-per-node={n}\n#SBATCH --gpus-per-node={n}\n#SBATCH --cpus-per-task=12\n"
                     "#SBATCH --exclusive\n#SBATCH --time=24:00:00\n")
        tasks, tasks_var = "one task per GPU the rollout engines leave", ""
    else:
        ranks, example = f"{n} process{'es' if n > 1 else ''}", "trainer.total_training_steps=5"
        resources = (f"#SBATCH --ntasks-per-node={n}\n#SBATCH --cpus-per-task={max(4 // n, 1)}\n"
                     "#SBATCH --time=01:00:00\n")
        tasks = f"{n} per node unless --ntasks-per-node says otherwise"
        tasks_var = f" DEFAULT_TASKS_PER_NODE={n}"
    fields = dict(name=name, description=desc, nproc=n, device=prof.device, ranks=ranks, example=example,
                  resources=resources, tasks=tasks, tasks_var=tasks_var)
    return {"run_torchrun.sh": TORCHRUN.format(**fields), "run_slurm.sbatch": SLURM.format(**fields)}


def recipe_names() -> list[str]:
    """Every recipe folder (``recipes/<name>/<name>.yaml``)."""
    return sorted(d.name for d in RECIPES.iterdir() if (d / f"{d.name}.yaml").is_file())


def differing() -> list[str]:
    """Paths (relative to recipes/) of the scripts that differ from their rendering."""
    out = []
    for name in recipe_names():
        for fn, text in render(name, profile_of(name)).items():
            path = RECIPES / name / fn
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                out.append(f"{name}/{fn}")
    return out


def write(name: str, prof: Profile) -> None:
    for fn, text in render(name, prof).items():
        path = RECIPES / name / fn
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a script differs from its rendering")
    ap.add_argument("--new", metavar="NAME", help="write the scripts of a new recipe (needs --device, --nproc)")
    ap.add_argument("--device", choices=("cpu", "gpu"))
    ap.add_argument("--nproc", type=int)
    args = ap.parse_args(argv)
    if args.new:
        if not args.device or not args.nproc or args.nproc < 1:
            ap.error("--new NAME needs --device cpu|gpu and --nproc N >= 1")
        write(args.new, Profile(args.device, args.nproc))
        return 0
    if args.check:
        bad = differing()
        if bad:
            print("not rendered from recipes/_launch/render.py (run it to rewrite them): " + ", ".join(bad),
                  file=sys.stderr)
            return 1
        return 0
    for name in recipe_names():
        write(name, profile_of(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
