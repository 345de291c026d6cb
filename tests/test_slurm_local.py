"""The CPU recipe's run_slurm.sbatch, unchanged, on a REAL 2-node Slurm cluster on this machine
(tests/slurm_local.py: one slurmctld, slurmd -N n1 / -N n2 on 127.0.0.1, Debian's packages installed when
missing).  `sbatch -N 2` runs the Ray head on n1, a Ray worker on n2 and one trainer rank per node (TP2 across
the two nodes); two jobs submitted at once onto the same nodes both succeed (ports from the job id, a Ray
cluster and token per job).  Skips only when Slurm cannot be installed, with the reason."""
from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

import pytest

from rlhf.mcore.distributed import expand_slurm_nodelist, slurm_job_ports
from tests.slurm_local import LocalSlurm, ensure_slurm_installed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RECIPE = "gsm8k_ppo_tiny_cpu"
JOB_TIMEOUT_S = 1200
# our own GSM8K-format questions (question / answer with "#### N"): the recipe's data path, no download
QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
             ("A box holds 6 pens. How many pens are in 2 boxes?", "6 * 2 = 12\n#### 12"),
             ("Sara reads 5 pages a day for 3 days. How many pages does she read?", "5 * 3 = 15\n#### 15"),
             ("There are 10 birds and 4 fly away. How many are left?", "10 - 4 = 6\n#### 6")]


@pytest.fixture(scope="module")
def slurm():
    reason = ensure_slurm_installed()
    if reason:
        print(f"SKIP tests/test_slurm_local.py: {reason}")
        pytest.skip(reason)
    with LocalSlurm(nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gsm8k")
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                  for q, a in QUESTIONS * 2))
    return d


def submit(slurm: LocalSlurm, out: Path, data: Path) -> int:
    """sbatch the recipe's script as it is in the repository; only sbatch options and config overrides vary:
    2 nodes x 1 rank (TP2 spans both), 1 CPU per rank, one training step with a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    return slurm.sbatch(["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={out}/%x-%j.out",
                         f"recipes/{RECIPE}/run_slurm.sbatch",
                         f"data.train_files={data}/train.jsonl", f"data.val_files={data}/test.jsonl",
                         f"trainer.default_local_dir={out}/run", "model.warmup_steps=5",
                         "trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.test_freq=-1",
                         "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=[console]",
                         "data.max_response_length=8"], cwd=REPO)


def job_output(out: Path, job: int) -> str:
    return (out / f"{RECIPE}-{job}.out").read_text(errors="replace")


def engine_nodes(text: str) -> set[str]:
    """Nodes whose Ray worker logs (prefixed "[ray <node>]" by the Slurm body) show the SGLang engine."""
    return {m.group(1) for m in re.finditer(r"^\[ray (\S+)\] .*(sglang|SGLang|:actor_name:\w*Engine)", text, re.M)}


def leftover_ray(job: int) -> list[str]:
    """Processes still running from this job's Ray (their command lines name its temp dirs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if f"rlhf-ray-{job}-" in cmd and state != "Z":
            found.append(f"{pid}: {cmd[:120]}")
    return found


def check_job(slurm: LocalSlurm, out: Path, job: int, state: tuple[str, int]) -> str:
    text = job_output(out, job)
    assert state == ("COMPLETED", 0), f"job {job}: {state}\n{text[-6000:]}\n{slurm.logs_tail()}"
    master_port, ray_port, _ = slurm_job_ports(job)
    assert f"Ray head 127.0.0.1:{ray_port} on n1" in text and f"torch.distributed 127.0.0.1:{master_port}" in text
    # the Ray head on n1, a worker on n2, and nothing else in this job's cluster
    assert f"[{RECIPE}] Ray: 2/2 nodes up (n1, n2)" in text, text[-4000:]
    assert re.search(r"^\[ray n1\] .*Ray runtime started", text, re.M)
    assert re.search(r"^\[ray n2\] .*Ray runtime started", text, re.M)
    # the trainer ranks spread over both nodes by srun (TP2 across them)
    assert f"[{RECIPE} n1] rank 0/2 (local 0) on n1" in text and f"[{RECIPE} n2] rank 1/2 (local 0) on n2" in text
    assert re.search(r"^step 1: .*actor/pg_loss=", text, re.M) and f"[{RECIPE}] trainer exited with 0" in text
    run = out / "run"
    assert (run / "checkpoints" / "global_step_1").is_dir()
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (run / "hf_export" / "config.json").is_file() and list((run / "hf_export").glob("*.safetensors"))
    assert not leftover_ray(job), leftover_ray(job)
    assert not list(Path("/tmp").glob(f"rlhf-ray-{job}-*")), "a successful job leaves no Ray temp dir"
    return text


def test_nodelist_parser_agrees_with_scontrol(slurm):
    for nodelist in ("rack[1-2]-node[01-02]", "gpu-[01-03,07],cpu1", "node[8-10]", "n[1-2]"):
        hosts = slurm.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        assert expand_slurm_nodelist(nodelist) == hosts, nodelist


def test_cpu_recipe_sbatch_on_two_nodes(slurm, gsm8k_files, tmp_path):
    job = submit(slurm, tmp_path, gsm8k_files)
    (state,) = slurm.wait([job], JOB_TIMEOUT_S).values()
    text = check_job(slurm, tmp_path, job, state)
    print(f"engine ran on: {sorted(engine_nodes(text))}")
    # TODO(rollout placement): once the rollout placement option exists (engine on another node than rank 0),
    # pass it in submit() and assert here:  assert engine_nodes(text) == {"n2"}
    assert engine_nodes(text) <= {"n1", "n2"} and engine_nodes(text), "no SGLang engine log in the job output"


def test_two_jobs_share_the_nodes(slurm, gsm8k_files, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    job_a = submit(slurm, a, gsm8k_files)
    job_b = submit(slurm, b, gsm8k_files)
    states = slurm.wait([job_a, job_b], JOB_TIMEOUT_S)
    for out, job in ((a, job_a), (b, job_b)):
        check_job(slurm, out, job, states[job])
    # they really ran at the same time, on the same two nodes
    info = {}
    for job in (job_a, job_b):
        fields = dict(f.split("=", 1) for f in slurm.run(["scontrol", "-o", "show", "job", str(job)]).stdout.split()
                      if "=" in f)
        info[job] = (fields["NodeList"], datetime.fromisoformat(fields["StartTime"]),
                     datetime.fromisoformat(fields["EndTime"]))
    assert info[job_a][0] == info[job_b][0] == "n[1-2]"
    assert info[job_b][1] < info[job_a][2] and info[job_a][1] < info[job_b][2], f"jobs did not overlap: {info}"
    assert set(slurm_job_ports(job_a)).isdisjoint(slurm_job_ports(job_b))

