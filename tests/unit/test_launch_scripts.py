"""The recipes' launch scripts: thin per-recipe files over recipes/_launch/{torchrun.sh,slurm_body.sh}, run
with stubbed torchrun / Slurm commands (what they start, with which environment), Slurm host lists and the
job-id ports.  CPU only, fast.  The real Slurm runs are in tests/e2e/test_slurm_local.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parallel.distributed import detect_launch_env, expand_slurm_nodelist, slurm_job_ports

from tests.support.paths import REPO
LAUNCH = REPO / "recipes" / "_launch"
# recipe -> (ranks per node it is written for, device); the values of the scripts before the shared bodies
RECIPES = {
    "quickstart": (1, "cpu"), "gsm8k_ppo_tiny_cpu": (2, "cpu"), "grpo_tiny_cpu": (1, "cpu"),
    "rloo_tiny_cpu": (1, "cpu"), "reinforce_pp_tiny_cpu": (1, "cpu"), "dapo_tiny_cpu": (1, "cpu"),
    "dpo_tiny_cpu": (1, "cpu"), "gspo_tiny_cpu": (1, "cpu"), "cispo_tiny_cpu": (1, "cpu"),
    **{f"{name}_tiny_cpu": (1, "cpu") for name in ("sapo", "gpg", "gmpo", "clip_cov", "kl_cov", "remax", "opo",
                                                  "grpo_passk", "opd", "moe_r3")},
    "gsm8k_ppo_qwen2_7b": (8, "gpu"), "grpo_qwen2_7b": (8, "gpu"),
    "dapo_qwen2_7b": (8, "gpu"), "dpo_qwen2_7b": (8, "gpu"), "gpu_smoke": (1, "gpu"),
    "gsm8k_multiturn_qwen2_5_3b": (8, "gpu"), "calc_tool_tiny_cpu": (1, "cpu"),
}
SCRIPTS = sorted((REPO / "recipes").glob("*/run_*"))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC", "OMP_NUM_THREADS",
               "CUDA_DEVICE_MAX_CONNECTIONS", "RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "PYTHONPATH")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(extra)
    return env


def _stub(bindir: Path, name: str, body: str) -> None:
    p = bindir / name
    p.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    p.chmod(0o755)


# --------------------------------------------------------------------------- layout


def test_every_recipe_dir_has_both_thin_scripts():
    dirs = {p.name for p in (REPO / "recipes").iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert dirs == set(RECIPES)
    for name in RECIPES:
        for fn, body in (("run_torchrun.sh", "_launch/torchrun.sh"), ("run_slurm.sbatch", "_launch/slurm_body.sh")):
            text = (REPO / "recipes" / name / fn).read_text()
            code = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
            assert len(code) <= 4 and body in text, f"recipes/{name}/{fn} should be a few lines over {body}"
            assert f"RECIPE={name} " in text


def test_every_launch_script_is_rendered_from_the_one_template(tmp_path):
    """Each recipe keeps one data line (RECIPE=, DEFAULT_NPROC=, DEVICE=) and its config's description; the
    rest of both scripts is recipes/_launch/render.py's template, so a change there reaches every recipe."""
    r = subprocess.run([sys.executable, str(LAUNCH / "render.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the check can fail: a hand edit of one script is found and named
    import importlib.util

    spec = importlib.util.spec_from_file_location("render", LAUNCH / "render.py")
    render = importlib.util.module_from_spec(spec)
    sys.modules["render"] = render  # a dataclass needs its module registered
    try:
        spec.loader.exec_module(render)
    finally:
        del sys.modules["render"]
    script = REPO / "recipes" / "quickstart" / "run_torchrun.sh"
    text = script.read_text()
    try:
        script.write_text(text.replace("# Options of rlhf.main", "# options of rlhf.main"))
        assert render.differing() == ["quickstart/run_torchrun.sh"]
    finally:
        script.write_text(text)
    assert render.differing() == []


@pytest.mark.parametrize("script", SCRIPTS + sorted(LAUNCH.glob("*.sh")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_no_fixed_ports_and_no_ray_stop():
    """Past Slurm defects stay gone: fixed 29500/6379 ports, `ray stop` (kills other jobs' Ray)."""
    for p in SCRIPTS + sorted(LAUNCH.glob("*")):
        text = "\n".join(ln for ln in p.read_text().splitlines() if not ln.lstrip().startswith("#"))
        assert not re.search(r"\b(29500|6379)\b", text), p
        assert "ray stop" not in text, p
        assert "--overlap" not in text, p


# --------------------------------------------------------------------------- torchrun


def _fake_python(tmp_path: Path, log: Path) -> Path:
    """A PYTHON that logs how torchrun would be started; `-m rlhf.main --print-launch` (the launchers' question
    to the config) runs for real."""
    _stub(tmp_path, "fakepython", f'[[ "$*" == *--print-launch* ]] && exec {sys.executable} "$@"\n'
                                  f'echo "PWD=$PWD OMP=${{OMP_NUM_THREADS:-unset}} '
                                  f'CDMC=${{CUDA_DEVICE_MAX_CONNECTIONS:-unset}} ARGS=$*" > {log}\n')
    return tmp_path / "fakepython"


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("nproc", [None, "2"], ids=["default", "NPROC=2"])
def test_torchrun_script_dry_run(name, nproc, tmp_path):
    log = tmp_path / "log"
    _fake_python(tmp_path, log)
    extra = {"NPROC": nproc} if nproc else {}
    r = subprocess.run(["bash", str(REPO / "recipes" / name / "run_torchrun.sh"), "trainer.seed=3"],
                       env=_env(PYTHON=str(tmp_path / "fakepython"), **extra), capture_output=True, text=True,
                       cwd=tmp_path, timeout=30)
    assert r.returncode == 0, r.stderr
    line = log.read_text()
    assert f"PWD={REPO} " in line  # runs from the repository root
    ranks, device = RECIPES[name]
    n = int(nproc or ranks)
    assert (f"-m torch.distributed.run --standalone --nnodes=1 --nproc_per_node={n} -m rlhf.main recipe={name} "
            f"trainer.seed=3") in line
    if device == "cpu":  # the cores split between the ranks, as before
        assert f"OMP={max(1, (os.cpu_count() or 1) // n)} " in line and "CDMC=unset" in line
    else:
        assert "OMP=unset" in line and "CDMC=1 " in line


def _torchrun(tmp_path: Path, *overrides: str, **extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "log"
    r = subprocess.run(["bash", str(REPO / "recipes" / "gsm8k_ppo_qwen2_7b" / "run_torchrun.sh"), *overrides],
                       env=_env(PYTHON=str(_fake_python(tmp_path, log)), **extra), capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    return r, (log.read_text() if log.exists() else "")


def test_torchrun_leaves_the_disaggregated_engines_their_gpus(tmp_path):
    # 8 GPUs: 2 engines of TP2 keep 4, torchrun starts the other 4 as trainer ranks
    r, line = _torchrun(tmp_path / "a", "rollout.mode=disaggregated", "rollout.num_engines=2")
    assert r.returncode == 0, r.stderr
    assert "--nproc_per_node=4 -m rlhf.main recipe=gsm8k_ppo_qwen2_7b rollout.mode=disaggregated" in line, line
    assert "4 trainer rank(s); GPUs 4.. kept for the disaggregated engines (4)" in r.stderr
    # GPUS: this machine's GPUs; 1 engine of TP2 on 4 GPUs leaves 2
    r, line = _torchrun(tmp_path / "b", "rollout.mode=disaggregated", "rollout.num_engines=1", GPUS="4")
    assert r.returncode == 0 and "--nproc_per_node=2 " in line, r.stderr
    # colocated: every GPU
    r, line = _torchrun(tmp_path / "c", GPUS="4")
    assert r.returncode == 0 and "--nproc_per_node=4 " in line, r.stderr


def test_torchrun_refuses_when_the_engines_leave_no_gpu(tmp_path):
    # the recipe's 4 engines of TP2 take all 8 GPUs
    r, line = _torchrun(tmp_path, "rollout.mode=disaggregated")
    assert r.returncode == 2 and not line, "torchrun must not start"
    assert ("rollout.num_engines=4 engine(s) x rollout.tensor_model_parallel_size=2 take 8 of this node's 8 GPUs "
            "and leave none for the trainer; lower rollout.num_engines, use rollout.mode=colocated") in r.stderr


# --------------------------------------------------------------------------- Slurm body (stubbed Slurm)


def _slurm_dry_run(name: str, tmp_path: Path, job_id: int = 1234, srun_rc: int = 0, overrides=("trainer.seed=3",),
                   **extra):
    """Run recipes/<name>/run_slurm.sbatch on a fake 2-node allocation (SLURM_JOB_NODELIST=node01: one node):
    stub scontrol (node01, node02 with NodeAddr 10.0.0.1/2) and srun (logs its arguments and the environment
    the tasks get)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "srun.log"
    _stub(tmp_path, "scontrol", """
        if [[ $1 == show && $2 == hostnames ]]; then echo node01; [[ $3 == node01 ]] || echo node02; exit 0; fi
        if [[ $1 == show && $2 == node ]]; then n=${@: -1}; echo "NodeName=$n Arch=x86_64 NodeAddr=10.0.0.${n: -1} State=IDLE"; exit 0; fi
        exit 1
    """)
    _stub(tmp_path, "srun", f"""
        {{ echo "ARGS $*"
          for v in MASTER_ADDR MASTER_PORT RAY_ADDRESS RAY_PORT RAY_CLIENT_PORT RAY_AUTH_MODE RAY_AUTH_TOKEN \\
                   OMP_NUM_THREADS CUDA_DEVICE_MAX_CONNECTIONS PYTHONPATH RLHF_SLURM_NODES RLHF_GPUS_PER_NODE; do
              echo "ENV $v=${{!v:-}}"
          done; }} >> {log}
        exit {srun_rc}
    """)
    env = _env(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=str(job_id),
               SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(REPO),
               SLURM_CPUS_PER_TASK="4")
    env.update(extra)
    r = subprocess.run(["bash", str(REPO / "recipes" / name / "run_slurm.sbatch"), *overrides], env=env,
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    args = [ln[5:] for ln in lines if ln.startswith("ARGS ")]
    envs = dict(ln[4:].split("=", 1) for ln in lines if ln.startswith("ENV "))
    return r, args, envs


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_slurm_script_dry_run(name, tmp_path):
    ranks, device = RECIPES[name]
    extra = {"SLURM_GPUS_ON_NODE": "4"} if device == "gpu" else {}
    r, args, env = _slurm_dry_run(name, tmp_path, **extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(args) == 1, f"one srun step (Ray runs inside it), got {args}"
    step = args[0]
    assert step.endswith(f"bash {LAUNCH}/slurm_task.sh python -m rlhf.main recipe={name} trainer.seed=3"), step
    assert "--nodes=2 " in step and "--kill-on-bad-exit=1" in step and "--cpus-per-task=4 " in step
    master_port, ray_port, client_port = slurm_job_ports(1234)
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == str(master_port)  # node01's NodeAddr
    assert env["RAY_ADDRESS"] == f"10.0.0.1:{ray_port}" and env["RAY_CLIENT_PORT"] == str(client_port)
    assert env["RAY_AUTH_MODE"] == "token" and re.fullmatch(r"[0-9a-f]{32}", env["RAY_AUTH_TOKEN"])
    assert env["RLHF_SLURM_NODES"] == "node01 node02" and env["PYTHONPATH"].split(":")[0] == str(REPO)
    if device == "gpu":  # GPUs per node from the allocation (4 here), not the 8 the recipe asks for by default
        assert "--ntasks-per-node=4 " in step and "--gpus-per-node=4 " in step and env["RLHF_GPUS_PER_NODE"] == "4"
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    else:
        assert f"--ntasks-per-node={ranks} " in step and "--gpus-per-node" not in step
        assert env["OMP_NUM_THREADS"] == "4" and env["RLHF_GPUS_PER_NODE"] == "0"
    sbatch = (REPO / "recipes" / name / "run_slurm.sbatch").read_text()
    assert "#SBATCH --nodes=" in sbatch and f"#SBATCH --ntasks-per-node={ranks}\n" in sbatch
    assert f"[{name}] trainer exited with 0" in r.stdout


def test_slurm_tasks_per_node_follow_the_allocation(tmp_path):
    r, args, _ = _slurm_dry_run("gsm8k_ppo_tiny_cpu", tmp_path / "cpu", SLURM_NTASKS_PER_NODE="1")
    assert r.returncode == 0 and "--ntasks-per-node=1 " in args[0]
    r, args, _ = _slurm_dry_run("gsm8k_ppo_qwen2_7b", tmp_path / "gpu", SLURM_GPUS_PER_NODE="h100:2")
    assert r.returncode == 0 and "--ntasks-per-node=2 " in args[0] and "--gpus-per-node=2 " in args[0]


def test_slurm_leaves_the_disaggregated_engines_their_gpus(tmp_path):
    one_node = dict(SLURM_GPUS_ON_NODE="8", SLURM_JOB_NODELIST="node01", SLURM_NNODES="1")
    r, args, _ = _slurm_dry_run("gsm8k_ppo_qwen2_7b", tmp_path / "one", overrides=(
        "rollout.mode=disaggregated", "rollout.num_engines=2"), **one_node)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--ntasks-per-node=4 " in args[0] and "--gpus-per-node=8 " in args[0]  # 4 ranks, the step has all 8 GPUs
    # two nodes: srun's tasks per node are uniform, the engines take the GPUs after all the trainer's: refused
    r, args, _ = _slurm_dry_run("gsm8k_ppo_qwen2_7b", tmp_path / "two", overrides=(
        "rollout.mode=disaggregated", "rollout.num_engines=2"), SLURM_GPUS_ON_NODE="8")
    assert r.returncode == 1 and not args
    assert "rollout.mode=disaggregated on 2 GPU nodes" in r.stderr and "sbatch -N 1" in r.stderr
    # no GPU left on the one node: rlhf.main's message, no step started
    r, args, _ = _slurm_dry_run("gsm8k_ppo_qwen2_7b", tmp_path / "none", overrides=("rollout.mode=disaggregated",),
                                **one_node)
    assert r.returncode == 2 and not args and "leave none for the trainer" in r.stderr


def test_slurm_gpu_recipe_without_gpus_fails_clearly(tmp_path):
    r, args, _ = _slurm_dry_run("grpo_qwen2_7b", tmp_path)
    assert r.returncode == 1 and not args
    assert "no GPUs in this allocation" in r.stderr and "--gpus-per-node" in r.stderr


def test_slurm_exit_code_and_ports_per_job(tmp_path):
    r, _, env_a = _slurm_dry_run("quickstart", tmp_path / "a", job_id=77, srun_rc=3)
    assert r.returncode == 3 and "[quickstart] trainer exited with 3" in r.stdout
    _, _, env_b = _slurm_dry_run("quickstart", tmp_path / "b", job_id=78)
    ports_a = {env_a["MASTER_PORT"], env_a["RAY_PORT"], env_a["RAY_CLIENT_PORT"]}
    ports_b = {env_b["MASTER_PORT"], env_b["RAY_PORT"], env_b["RAY_CLIENT_PORT"]}
    assert len(ports_a) == 3 and not ports_a & ports_b  # two jobs on one node never share a port
    assert env_a["RAY_AUTH_TOKEN"] != env_b["RAY_AUTH_TOKEN"]


def test_slurm_outside_allocation_fails_clearly(tmp_path):
    r = subprocess.run(["bash", str(REPO / "recipes" / "quickstart" / "run_slurm.sbatch")], env=_env(),
                       capture_output=True, text=True, cwd=REPO, timeout=30)
    assert r.returncode == 1 and "not inside a Slurm allocation" in r.stderr
    r = subprocess.run(["bash", str(REPO / "recipes" / "quickstart" / "run_slurm.sbatch")],
                       env=_env(SLURM_SUBMIT_DIR=str(tmp_path)), capture_output=True, text=True, cwd=tmp_path,
                       timeout=30)
    assert r.returncode == 2 and "submit from the repository root" in r.stderr


# --------------------------------------------------------------------------- host lists and ports


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu-[01-03,07],cpu1", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu1"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("a,rack[1,3]-n[7-8]x,b", ["a", "rack1-n7x", "rack1-n8x", "rack3-n7x", "rack3-n8x", "b"]),
    ("n1", ["n1"]),
])
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad, match", [("gpu-[01-03", "unbalanced"), ("gpu-01]", "unbalanced"),
                                        ("n[3-1]", "backwards"), ("n[a-b]", "bad range"), ("n[]", "bad range")])
def test_expand_slurm_nodelist_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        expand_slurm_nodelist(bad)


def test_slurm_job_ports_match_the_shell_formula():
    for job in (0, 1, 1234, 3999, 4000, 987654):
        base = int(subprocess.run(["bash", "-c", f"SLURM_JOB_ID={job}; echo $(( 20000 + 3 * (SLURM_JOB_ID % 4000) ))"],
                                  capture_output=True, text=True).stdout)
        assert slurm_job_ports(job) == (base, base + 1, base + 2)
        assert 20000 <= base and base + 2 < 32768  # below Linux's ephemeral port range
    assert slurm_job_ports(5) != slurm_job_ports(6)
    # a Slurm task without MASTER_PORT rendezvouses on its job's port, not a fixed 29500
    env = detect_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1234",
                             "SLURM_JOB_NODELIST": "rack[1-2]-node[01-02]"})
    assert (env.master_addr, env.master_port, env.launcher) == ("rack1-node01", slurm_job_ports(1234)[0], "slurm")
