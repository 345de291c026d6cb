"""verl's Megatron example commands (tests/support/fixtures/verl_megatron_examples.json) run for 2 training steps on
CPU, each in verl's own form (its ``--config-path`` / ``--config-name``, from an empty folder), scaled down by the
fixed overrides of :func:`scale_down` appended to the script's own command line::

    python -m tests.support.verl_examples --run2 [--timeout 240] [--only SUBSTRING ...]

Only the commands that compose (``--cfg``, as ``--count`` counts them, on its one-row data) are run, one after the
other, each under a timeout, in a scratch folder under /tmp.  A run counts when it exits 0 and printed step 2's metrics
(``step 2: actor/...`` of the console logger).  The data: the shared GSM8K copy (``../shared/data/gsm8k``) through
:func:`rlhf.data.gsm8k.preprocess_gsm8k` (the first 32 rows of each split) into the scratch folder, or the embedded
arithmetic task where the copy is absent.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.paths import REPO

GSM8K_DIR = REPO / ".." / "shared" / "data" / "gsm8k"

#: the roles whose megatron layout is set to one process (verl keys)
_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
#: the fixed scale-down (verl keys), appended after the script's overrides; {…} filled by :func:`scale_down`
SCALE_DOWN = [
    "data.train_files={train}", "data.val_files={test}",
    "data.train_batch_size=4", "data.val_batch_size=4", "data.max_prompt_length=256", "data.max_response_length=32",
    "data.filter_overlong_prompts=False", "data.truncation=left",
    "actor_rollout_ref.model.path={model}", "critic.model.path={model}",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    *(f"{role}.megatron.{k}={v}" for role in _ROLES for k, v in (
        ("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
        ("virtual_pipeline_model_parallel_size", "null"), ("context_parallel_size", 1),
        ("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", "null"),
        ("use_dist_checkpointing", False))),
    "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
    "trainer.logger=[console]", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.default_local_dir={ckpt}",
    "trainer.resume_mode=disable",
]
#: DAPO's overlong buffer (``reward_model.reward_kwargs.overlong_buffer_cfg.len``) where a script sets one: it must
#: fit within data.max_response_length (32 here)
OVERLONG_BUFFER = 8
#: megatron optimizer options that save GPU memory and need a CUDA device / Transformer Engine (parallel/optim.py
#: refuses them on CPU, naming the fix): turned off where a script turns them on
GPU_OPTIMIZER_OPTIONS = tuple(f"actor_rollout_ref.actor.optim.override_optimizer_config.{k}"
                              for k in ("optimizer_cpu_offload", "use_precision_aware_optimizer"))
#: the line a run prints when step 2 is done (rlhf/trainer/loggers.py: console_lines)
STEP2 = re.compile(r"^.*step 2: (actor|critic|timing_s|perf)/", re.M)


def _value(overrides: list[str], key: str):
    """The value the command line gives ``key`` (last one wins; with or without ``+``), or None."""
    found = None
    for o in overrides:
        k, _, v = o.partition("=")
        if k.lstrip("+") == key:
            found = v
    return found


def scale_down(overrides: list[str], paths: dict) -> list[str]:
    """The overrides appended to an example's own ``overrides`` (verl keys, ``key=value``) to run it for 2 steps on
    one CPU process: :data:`SCALE_DOWN` with ``paths`` (train, test, model, ckpt) filled in, ``rollout.n`` the
    script's capped at 2 (1 when it sets none), and the reward model's path set to ``paths["model"]`` when the
    script enables a reward model.  Plain ``key=value`` even over a key the script adds with ``+`` (Hydra takes a
    later ``k=v`` over ``+k=v``; a second ``+k`` would be an error)."""
    n = _value(overrides, "actor_rollout_ref.rollout.n")
    n = min(int(n), 2) if n not in (None, "") else 1
    out = [s.format(n=n, **paths) for s in SCALE_DOWN]
    if str(_value(overrides, "reward_model.enable")).lower() == "true":
        out.append(f"reward_model.model.path={paths['model']}")
    for key in GPU_OPTIMIZER_OPTIONS:  # GPU memory only: refused on CPU (parallel/optim.py)
        if str(_value(overrides, key)).lower() == "true":
            out.append(f"{key}=False")
    for key in ("reward_model.reward_kwargs.overlong_buffer_cfg.len", "reward_model.reward_kwargs.max_resp_len"):
        if _value(overrides, key) is not None:  # DAPO's overlong buffer: its tokens within the response's 32
            out.append(f"{key}={OVERLONG_BUFFER if key.endswith('.len') else 32}")
    return out


def prepare_data(root: Path) -> dict:
    """{train, test} parquet files under ``root``: GSM8K's first 32 rows of each split through the repo's
    preprocessing, or the embedded arithmetic task where the shared copy is absent."""
    if not (GSM8K_DIR / "train.jsonl").is_file():
        return {"train": "embedded://arithmetic", "test": "embedded://arithmetic"}
    from rlhf.data.gsm8k import preprocess_gsm8k

    paths = preprocess_gsm8k(root / "gsm8k", local_path=GSM8K_DIR.resolve(), max_samples=32)
    return {"train": str(paths["train"]), "test": str(paths["test"])}


def first_error(log: str) -> str:
    """The first line of a failed run's output that names the error (a config problem, an exception line)."""
    lines = log.splitlines()
    for pat in (r"^  - ", r"^[\w.]*(Error|Exception): ", r"(Error|error):"):
        for line in (lines if pat == r"^  - " else reversed(lines)):  # a config problem; else the last exception
            if re.search(pat, line) and "Warning" not in line:
                return line.strip()[:240]
    return (lines[-1].strip() if lines else "(no output)")[:240]


def run_one(name: str, entry: dict, paths: dict, work: Path, timeout_s: float) -> dict:
    """Run example ``name`` for 2 steps in ``work`` (an empty folder); {ran, rc, seconds, error, log}."""
    work.mkdir(parents=True, exist_ok=True)
    own = [o.format(**paths) for o in entry["overrides"]]
    argv = [sys.executable, "-m", "rlhf.main", *entry["options"], *own, *scale_down(entry["overrides"], paths)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "CUDA_VISIBLE_DEVICES": ""}
    log_path = work / "run.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        try:
            rc = subprocess.run(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = log_path.read_text(errors="replace")
    ran = rc == 0 and bool(STEP2.search(text))
    error = "" if ran else (f"timeout after {timeout_s:.0f} s" if rc is None else first_error(text))
    return {"ran": ran, "rc": rc, "seconds": round(time.time() - t0), "error": error, "log": str(log_path)}


def run2_main(argv: list[str]) -> None:
    """``--run2``: compose every example (as ``--count``), run those that compose for 2 steps, print the table."""
    from tests.support.verl_examples import count_paths, count_verl_form, examples

    timeout_s = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 240.0
    only = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--only"]
    os.environ.setdefault("WANDB_MODE", "offline")
    tmp = Path(tempfile.mkdtemp(prefix="verl_run2_"))
    (tmp / "empty").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp / "empty")
    ok, bad = count_verl_form(count_paths(tmp))  # composes: exactly as --count counts
    os.chdir(cwd)
    paths = {**count_paths(tmp), **prepare_data(tmp)}
    results = {}
    for i, name in enumerate(ok):
        if only and not any(s in name for s in only):
            continue
        results[name] = run_one(name, examples()[name], paths, tmp / f"run{i:02d}", timeout_s)
        r = results[name]
        print(f"{'ran   ' if r['ran'] else 'failed'} {r['seconds']:4d}s {name} {r['error']}", flush=True)
    ran = [n for n, r in results.items() if r["ran"]]
    print(f"\ncompose {len(ok)}/{len(ok) + len(bad)}, run 2 steps {len(ran)}/{len(results)}  (logs: {tmp})")
    print("| script | composes | 2 steps | first error |\n| --- | --- | --- | --- |")
    for name in examples():
        r = results.get(name)
        print(f"| {name} | {'yes' if name in ok else 'no'} | "
              f"{'-' if r is None else ('yes' if r['ran'] else 'no')} | {'' if r is None else r['error']} |")
    (tmp / "results.json").write_text(json.dumps(results, indent=1))
