"""verl's Megatron example commands (fixtures/verl_megatron_examples.json) run through ``python -m rlhf.main --cfg``
in-process, and a small verl-style config directory built from the key set of verl's ``verl/trainer/config``
(its group layout and the defaults that matter here), so CI covers verl's own config directory without a copy
of verl.

The fixture holds command lines only (never verl's code).  It is made from a fetched copy of verl by
:func:`extract_examples`, which runs every ``examples/**/*.sh`` of that copy under bash with ``python`` (and
``torchrun``, ``ray job submit --``, ``nvidia-smi``, ``pip``, ...) replaced by stubs that record the command
line, so each script's shell variables and arithmetic expand as they do for a verl user; a script counts as a
Megatron example when it starts ``verl.trainer.main_ppo`` with a Megatron config or strategy::

    python -m tests.support.verl_examples <verl git dir> <verl-recipe git dir>   # rewrites the fixture
    python -m tests.support.verl_examples --count   # how many compose in verl's own form (--config-name, --cfg)
    python -m tests.support.verl_examples --run2    # and of those, how many run 2 steps on CPU (verl_run2.py)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from tests.support.paths import REPO

FIXTURE = REPO / "tests" / "support" / "fixtures" / "verl_megatron_examples.json"


def examples() -> dict:
    """``{script: {"options": [--config-path=..., --config-name=...], "overrides": [key=value, ...]}}``."""
    return json.loads(FIXTURE.read_text())["examples"]


#: overrides whose value is a path of the user's machine -> the placeholder the tests fill in
PLACEHOLDERS = {"data.train_files": "{train}", "data.val_files": "{test}", "actor_rollout_ref.model.path": "{model}",
                "critic.model.path": "{model}", "reward_model.model.path": "{model}",
                "trainer.default_local_dir": "{ckpt}",
                **{f"{role}.megatron.dist_checkpointing_path": "{mcore}"
                   for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")}}

#: the job variables of the clusters verl's scripts were written for (one node of 8 GPUs), which the scripts read
#: for trainer.nnodes / trainer.n_gpus_per_node
CLUSTER_ENV = {"ARNOLD_WORKER_GPU": "8", "ARNOLD_WORKER_NUM": "1", "SLURM_GPUS_PER_NODE": "8", "SLURM_NNODES": "1",
               "SLURM_JOB_NUM_NODES": "1"}

_STUB_PY = r"""#!/bin/sh
# records a python / torchrun command line (one JSON list a line); "python -c CODE" runs CODE (scripts compute values)
if [ "$1" = "-c" ]; then exec "$REAL_PYTHON" "$@"; fi
exec "$REAL_PYTHON" -c 'import json, os, sys
open(os.environ["CAPTURE"], "a").write(json.dumps(sys.argv[1:]) + "\n")' "$@"
"""
_STUB_RAY = """#!/bin/sh
# ray job submit ... -- CMD: runs CMD (its python is the stub); other ray commands do nothing
while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
[ $# -gt 0 ] && shift && exec "$@"
exit 0
"""
_STUB_GPUS = """#!/bin/sh
for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done
"""
_STUB_NOOP = "#!/bin/sh\nexit 0\n"


def _is_megatron_run(argv: list[str]) -> bool:
    """A verl PPO-trainer command line with a Megatron config or actor strategy."""
    if "verl.trainer.main_ppo" not in argv:
        return False
    opts = [a for a in argv if a.startswith("--config-name") or a.endswith("strategy=megatron")]
    name = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config-name"), "")
    return any("megatron" in a for a in opts) or "megatron" in name


def _example_entry(argv: list[str]) -> dict:
    """``{"options": [--config-path=..., --config-name=...], "overrides": [...]}`` of a recorded command line:
    its own options (verl's defaults, config / ppo_trainer, when absent), the overrides after the module name
    with the paths of :data:`PLACEHOLDERS` replaced."""
    args = argv[argv.index("verl.trainer.main_ppo") + 1:]
    opts, overrides, i = {}, [], 0
    while i < len(args):
        a = args[i]
        if a in ("--config-path", "--config-name") and i + 1 < len(args):
            opts[a], i = args[i + 1], i + 2
            continue
        if a.startswith(("--config-path=", "--config-name=")):
            k, v = a.split("=", 1)
            opts[k] = v
        elif "=" in a and not a.startswith("-"):
            key, value = a.split("=", 1)
            overrides.append(f"{key}={PLACEHOLDERS.get(key.lstrip('+'), value)}")
        i += 1
    return {"options": [f"--config-path={opts.get('--config-path', 'config')}",
                        f"--config-name={opts.get('--config-name', 'ppo_trainer')}"], "overrides": overrides}


def _git(git_dir: str, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", git_dir, *args], capture_output=True, check=True).stdout


def extract_examples(verl_git_dir: str, commit: str = "HEAD", recipe_git_dir: str | None = None,
                     timeout_s: float = 30.0) -> dict:
    """The fixture's content for verl at `commit` of the git directory `verl_git_dir`: ``{"_about": ...,
    "commit": <sha>, "recipe_commit": <sha or None>, "examples": {<name>: entry}}`` for every Megatron example
    (module docstring): the scripts of verl's ``examples/`` (named by their path under it) and, with
    `recipe_git_dir` (a copy of verl-project/verl-recipe), of the ``recipe/`` submodule at the commit verl pins
    (named ``recipe/<path>``); a script that starts several such runs gets ``#2``, ``#3`` ... after its name.
    Runs each script with bash in a scratch copy of them (the working directory: verl's root), with a scratch
    HOME, :data:`CLUSTER_ENV` and the stubs first on PATH; a variable a ``set -u`` script needs is set to a path
    (``/data_root`` for DATA_ROOT); scripts that fail after the command are kept, scripts that time out are
    skipped."""
    sha = _git(verl_git_dir, "rev-parse", commit).decode().strip()
    recipe_sha = None
    examples: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root, stubs, home = Path(tmp) / "verl", Path(tmp) / "bin", Path(tmp) / "home"
        for d in (root, stubs, home):
            d.mkdir()
        subprocess.run(["tar", "x", "-C", str(root)], input=_git(verl_git_dir, "archive", sha, "examples"), check=True)
        if recipe_git_dir is not None:
            recipe_sha = _git(verl_git_dir, "ls-tree", sha, "recipe").decode().split()[2]  # the submodule's pin
            (root / "recipe").mkdir()
            subprocess.run(["tar", "x", "-C", str(root / "recipe")], input=_git(recipe_git_dir, "archive", recipe_sha),
                           check=True)
        for name, body in [("python", _STUB_PY), ("python3", _STUB_PY), ("torchrun", _STUB_PY), ("ray", _STUB_RAY),
                           ("nvidia-smi", _STUB_GPUS)] + [(n, _STUB_NOOP) for n in (
                               "pip", "pip3", "huggingface-cli", "hf", "wget", "git", "modelscope", "sleep", "nsys",
                               "uv", "srun", "sbatch", "docker", "hdfs")]:
            (stubs / name).write_text(body)
            (stubs / name).chmod(0o755)
        scripts = sorted(p.relative_to(root).as_posix() for d in ("examples", "recipe") if (root / d).is_dir()
                         for p in (root / d).rglob("*.sh"))
        for script in scripts:
            name = script.removeprefix("examples/")
            capture = Path(tmp) / "capture.jsonl"
            capture.write_text("")
            env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(home), "CAPTURE": str(capture),
                   "REAL_PYTHON": sys.executable, "LANG": "C.UTF-8", **CLUSTER_ENV}
            for _ in range(10):  # `set -u` scripts: each variable a user must export gets a path-like value
                try:
                    done = subprocess.run(["bash", script], cwd=root, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    break
                unbound = re.search(r"([A-Za-z_][A-Za-z0-9_]*): unbound variable", done.stderr)
                if not unbound or unbound.group(1) in env:
                    break
                env[unbound.group(1)] = f"/{unbound.group(1).lower()}"
            runs = [json.loads(line.replace(f"{root}/", "")) for line in capture.read_text().splitlines()
                    if line.strip()]
            runs = [r for r in runs if _is_megatron_run(r)]
            for k, argv in enumerate(runs):
                examples[name if k == 0 else f"{name}#{k + 1}"] = _example_entry(argv)
    about = (f"The key=value overrides of verl's Megatron example commands (examples/**/*.sh of verl {sha[:9]}"
             + (f" and recipe/**/*.sh of its verl-recipe submodule {recipe_sha[:9]}" if recipe_sha else "") +
             f" that start verl.trainer.main_ppo with a Megatron config or strategy, as its shell expands them; "
             f"options: "
             f"verl's --config-path/--config-name). Data, model and checkpoint paths are placeholders ({{train}}, "
             f"{{test}}, {{model}}, {{ckpt}}, {{mcore}}: a megatron dist checkpoint) for tiny local ones. Command "
             f"lines only. Made by "
             f"tests/support/verl_examples.py:extract_examples.")
    return {"_about": about, "commit": sha, "recipe_commit": recipe_sha, "examples": examples}


def example_args(name: str, paths: dict, config_dir: Path | None = None) -> list[str]:
    """The ``--cfg`` command line of example ``name``: its overrides with ``paths`` (train, test, model, ckpt)
    filled in, after ``--config-path config_dir --config-name <its name>`` when ``config_dir`` is given."""
    ex = examples()[name]
    opts = []
    if config_dir is not None:
        opts = ["--config-path", str(config_dir), "--config-name", ex["options"][1].split("=", 1)[1]]
    return ["--cfg", *opts, *(o.format(**paths) for o in ex["overrides"])]


def run_cfg(argv: list[str]) -> tuple[int, str, str]:
    """``rlhf.main.main(["--cfg", *argv])`` in this process (compose and check only): (exit code, stdout,
    stderr)."""
    from rlhf.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv if "--cfg" in argv else ["--cfg", *argv])
    return code, out.getvalue(), err.getvalue()


def problems(stderr: str) -> list[str]:
    """The problem lines of a config error (``  - ...``)."""
    return [line[4:] for line in stderr.splitlines() if line.startswith("  - ")]


_ENGINE = """\
    param_offload: false
    grad_offload: false
    optimizer_offload: false
    tensor_model_parallel_size: 1
    expert_model_parallel_size: 1
    expert_tensor_parallel_size: null
    pipeline_model_parallel_size: 1
    virtual_pipeline_model_parallel_size: null
    context_parallel_size: 1
    sequence_parallel: true
    use_distributed_optimizer: true
    use_dist_checkpointing: false
    seed: 42
    override_ddp_config: {}
    override_transformer_config:
      recompute_granularity: null
      recompute_modules: [core_attn]
      recompute_method: null
      recompute_num_layers: null
      attention_backend: flash
    override_mcore_model_config: {}
    use_mbridge: false
    dtype: bfloat16
"""
_MAIN = """\
    defaults:
      - engine@actor_rollout_ref.actor.megatron: megatron
      - engine@actor_rollout_ref.ref.megatron: megatron
      - engine@critic.megatron: megatron
      - _self_
    actor_rollout_ref:
      model:
        path: ~/models/deepseek-llm-7b-chat
        enable_gradient_checkpointing: true
      actor:
        strategy: megatron
        ppo_mini_batch_size: 256
        optim:
          lr: 1e-6
      ref:
        megatron:
          tensor_model_parallel_size: ${oc.select:actor_rollout_ref.actor.megatron.tensor_model_parallel_size,1}
          override_transformer_config: ${oc.select:actor_rollout_ref.actor.megatron.override_transformer_config,{}}
      rollout:
        name: vllm
        multi_turn:
          enable: false
    critic:
      strategy: megatron
      model:
        path: ~/models/deepseek-llm-7b-chat
        enable_gradient_checkpointing: true
      ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
      optim:
        lr: 1e-5
    data:
      train_batch_size: 1024
    trainer:
      logger: [console, wandb]
"""


def write_verl_config_dir(root: Path) -> Path:
    """A verl-style ``verl/trainer/config`` under ``root`` (``ppo_megatron_trainer.yaml`` composing
    ``engine/megatron.yaml`` into the actor, the reference and the critic, as verl's does); returns it."""
    conf = root / "verl" / "trainer" / "config"
    (conf / "engine").mkdir(parents=True, exist_ok=True)
    (conf / "engine" / "megatron.yaml").write_text(textwrap.dedent(_ENGINE))
    (conf / "ppo_megatron_trainer.yaml").write_text(textwrap.dedent(_MAIN))
    return conf


def count_verl_form(paths: dict) -> tuple[list, dict]:
    """(names that compose, {name: problem lines}) of every example in verl's own form: its --config-path /
    --config-name, run with ``--cfg`` from an empty folder (the current directory: the caller's), ``paths`` filled in
    (train, test, model, ckpt, mcore)."""
    ok, bad = [], {}
    for name, ex in examples().items():
        code, _, err = run_cfg(["--cfg", *ex["options"], *(o.format(**paths) for o in ex["overrides"])])
        (ok.append(name) if code == 0 else bad.__setitem__(name, problems(err) or err.strip().splitlines()[-1:]))
    return ok, bad


def count_paths(tmp: Path) -> dict:
    """The paths ``--count`` fills in (train, test, model, ckpt, mcore), written under ``tmp``: one GSM8K-style row,
    ``tiny://quickstart`` and a metadata-only dist checkpoint."""
    from tests.support.mcore_checkpoints import write_dcp

    row = {"prompt": "What is 2 + 3?", "data_source": "openai/gsm8k", "answer": "2 + 3 = 5\n#### 5"}
    for n in ("train", "test"):
        (tmp / f"{n}.jsonl").write_text(json.dumps(row) + "\n")
    mcore = write_dcp(tmp / "mcore", {"embedding.word_embeddings.weight": (512, 64)})
    return {"train": str(tmp / "train.jsonl"), "test": str(tmp / "test.jsonl"), "model": "tiny://quickstart",
            "ckpt": str(tmp / "ckpt"), "mcore": mcore}


def _count_main() -> None:
    """``python -m tests.support.verl_examples --count``: :func:`count_verl_form` with one GSM8K-style row,
    ``tiny://quickstart`` and a metadata-only dist checkpoint, printed."""
    os.environ.setdefault("WANDB_MODE", "offline")
    tmp = Path(tempfile.mkdtemp())
    paths = count_paths(tmp)
    (tmp / "empty").mkdir()
    os.chdir(tmp / "empty")
    ok, bad = count_verl_form(paths)
    print(f"{len(ok)} of {len(ok) + len(bad)} compose in verl's form")
    for name in ok:
        print("  composes", name)
    for name, lines in bad.items():
        print("  refused ", name, "|", " || ".join(line[:160] for line in lines[:3]))


if __name__ == "__main__" and sys.argv[1:] == ["--count"]:
    _count_main()
elif __name__ == "__main__" and sys.argv[1:2] == ["--run2"]:
    from tests.support.verl_run2 import run2_main

    run2_main(sys.argv[2:])
elif __name__ == "__main__":
    verl, recipe = (sys.argv[1:] + ["/work/.mirror/volcengine+verl/repo",
                                    "/work/.mirror/verl-project+verl-recipe/repo"][len(sys.argv) - 1:])[:2]
    out = extract_examples(verl, recipe_git_dir=recipe)
    FIXTURE.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(out['examples'])} examples of verl {out['commit'][:9]} -> {FIXTURE}")
