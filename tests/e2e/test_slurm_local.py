"""The CPU recipe's run_slurm.sbatch, unchanged, on a REAL 2-node Slurm cluster on this machine
(tests/support/slurm_local.py: one slurmctld, slurmd -N n1 / -N n2 on 127.0.0.1, Debian's packages installed when
missing).  `sbatch -N 2` runs the Ray head on n1, a Ray worker on n2 and one trainer rank per node (TP2 across
the two nodes); two jobs submitted at once onto the same nodes both succeed (ports from the job id, a Ray
cluster and token per job), one with its rollout engine disaggregated onto n2 (the other node than trainer rank
0's), the other with colocated engines on both nodes, each beside the trainer rank it syncs from.  Skips only when Slurm cannot be installed, with the reason."""
from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

import pytest

from parallel.distributed import expand_slurm_nodelist, slurm_job_ports
from tests.support.gsm8k_mini import ONE_STEP, check_one_step_run, data_overrides, write_gsm8k_mini
from tests.support.slurm_local import LocalSlurm, ensure_slurm_installed

pytestmark = pytest.mark.slow

from tests.support.paths import REPO
RECIPE = "gsm8k_ppo_tiny_cpu"
JOB_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def slurm():
    reason = ensure_slurm_installed()
    if reason:
        print(f"SKIP tests/e2e/test_slurm_local.py: {reason}")
        pytest.skip(reason)
    with LocalSlurm(nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory) -> Path:
    return write_gsm8k_mini(tmp_path_factory.mktemp("gsm8k"))


def submit(slurm: LocalSlurm, out: Path, data: Path, *overrides: str) -> int:
    """sbatch the recipe's script as it is in the repository; only sbatch options and config overrides vary:
    2 nodes x 1 rank (TP2 spans both), 1 CPU per rank, one training step with a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    return slurm.sbatch(["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={out}/%x-%j.out",
                         f"recipes/{RECIPE}/run_slurm.sbatch", *data_overrides(data),
                         f"trainer.default_local_dir={out}/run", *ONE_STEP, *overrides], cwd=REPO)


def job_output(out: Path, job: int) -> str:
    return (out / f"{RECIPE}-{job}.out").read_text(errors="replace")


def engine_nodes(text: str) -> set[str]:
    """Nodes whose Ray worker logs (prefixed "[ray <node>]" by the Slurm body) show the SGLang engine actor
    (Ray writes ``:actor_name:<class>`` into the log of the worker process that runs an actor)."""
    return {m.group(1) for m in re.finditer(r"^\[ray (\S+)\] .*:actor_name:SGLangEngine", text, re.M)}


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
    # the trainer ranks spread over both nodes by srun (one each)
    assert f"[{RECIPE} n1] rank 0/2 (local 0) on n1" in text and f"[{RECIPE} n2] rank 1/2 (local 0) on n2" in text
    assert f"[{RECIPE}] trainer exited with 0" in text
    check_one_step_run(text, out / "run")
    assert not leftover_ray(job), leftover_ray(job)
    assert not list(Path("/tmp").glob(f"rlhf-ray-{job}-*")), "a successful job leaves no Ray temp dir"
    return text


def test_nodelist_parser_agrees_with_scontrol(slurm):
    for nodelist in ("rack[1-2]-node[01-02]", "gpu-[01-03,07],cpu1", "node[8-10]", "n[1-2]"):
        hosts = slurm.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        assert expand_slurm_nodelist(nodelist) == hosts, nodelist


def test_two_jobs_at_once_on_two_nodes_engine_placement(slurm, gsm8k_files, tmp_path):
    """Two jobs of the recipe's script at once on the same 2 nodes (one Slurm round for every check):
    job a with the rollout engine disaggregated -> on n2, the other node than trainer rank 0's (n1);
    job b colocated, the trainer at TP1 (a rank per node) with two engines -> engine 0 on n1 beside rank 0, engine 1
    on n2 beside rank 1, the rank whose memory it maps in the weight sync (check mode reads the weights back from
    both).  Both succeed: no port or Ray clash."""
    a, b = tmp_path / "a", tmp_path / "b"
    job_a = submit(slurm, a, gsm8k_files, "rollout.mode=disaggregated", "rollout.weight_sync_check=true")
    job_b = submit(slurm, b, gsm8k_files, "parallel.tensor_model_parallel_size=1", "rollout.num_engines=2",
                   "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
                   "rollout.weight_sync_check=true")
    states = slurm.wait([job_a, job_b], JOB_TIMEOUT_S)
    text_a, text_b = (check_job(slurm, out, job, states[job]) for out, job in ((a, job_a), (b, job_b)))
    # where the engine was planned (rank 0's line) and where it really ran (its Ray worker's log lines)
    assert "[rollout] disaggregated: engine 0 on Ray node n2 (2 Ray node(s))" in text_a, text_a[-4000:]
    assert engine_nodes(text_a) == {"n2"}, text_a[-4000:]
    assert "[rollout] colocated: engine 0 on Ray node n1, engine 1 on Ray node n2 (2 Ray node(s))" in text_b, \
        text_b[-4000:]
    assert engine_nodes(text_b) == {"n1", "n2"}, text_b[-4000:]
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
