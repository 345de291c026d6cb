"""rlhf/faults.py (RLHF_FAULT parsing, the hit counter, SIGKILL of the whole process group) and the
checkpoint rules the fault matrix relies on (rlhf/trainer/checkpoint.py): folders are deleted under a
.deleting name, the tracker is the only pointer, a checkpoint of another model is refused."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlhf import faults
from rlhf.trainer.checkpoint import (MODEL_SUMMARY_KEYS, TRACKER, _delete, _write_tracker, check_model,
                                     latest_checkpoint, model_summary)

from tests.support.paths import ROOT


def test_parse_spec():
    assert faults.parse_spec("ckpt_before_rename@2, sync_weights") == {"ckpt_before_rename": 2, "sync_weights": 1}
    with pytest.raises(ValueError, match="unknown point 'ckpt'"):
        faults.parse_spec("ckpt@1")
    with pytest.raises(ValueError, match="hit '0' of 'step_start' must be an integer >= 1"):
        faults.parse_spec("step_start@0")


def test_maybe_fail_kills_the_whole_process_group_on_the_configured_hit(tmp_path):
    """A child (its own session) starts a grandchild in its group, then passes step_start three times with
    RLHF_FAULT=step_start@3: the FAULT line comes once, after 'pass 2', and both processes are gone."""
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {ROOT!r})
        from rlhf import faults
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(tmp_path / 'grandchild')!r}, "w").write(str(child.pid))
        for i in range(1, 5):
            faults.maybe_fail("step_start", step=i)
            print("pass", i, flush=True)
        """)
    env = dict(os.environ, RLHF_FAULT="step_start@3", RLHF_FAULT_RANK="0")
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert proc.returncode == -9
    assert proc.stdout.split() == ["pass", "1", "pass", "2"]
    assert "FAULT step_start hit 3 step=3: SIGKILL process group" in proc.stderr
    grandchild = int((tmp_path / "grandchild").read_text())
    import psutil

    try:
        psutil.Process(grandchild).wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_other_ranks_and_unarmed_points_do_nothing(monkeypatch):
    monkeypatch.setenv("RLHF_FAULT", "sync_weights")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    faults.maybe_fail("sync_weights")  # rank 1: never fires
    assert not faults.armed("sync_weights")
    monkeypatch.setenv("RANK", "0")
    assert faults.armed("sync_weights") and not faults.armed("ckpt_mid_save")
    faults.maybe_fail("step_start")  # not named
    monkeypatch.delenv("RLHF_FAULT")
    faults.maybe_fail("sync_weights")


def test_deleted_checkpoints_never_look_complete(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "global_step_2").mkdir(parents=True)
    (root / "global_step_2" / "trainer_state.pt").write_text("x")
    _write_tracker(str(root), 2)
    assert (root / TRACKER).read_text() == "2" and not (root / (TRACKER + ".tmp")).exists()
    assert latest_checkpoint(str(root)) == str(root / "global_step_2")
    _delete(str(root / "global_step_2"))
    assert sorted(os.listdir(root)) == [TRACKER]  # renamed to .deleting, then removed
    assert latest_checkpoint(str(root)) is None
    (root / "global_step_4.tmp").mkdir()  # a save that died before its rename is never picked
    (root / "global_step_6.deleting").mkdir()
    _write_tracker(str(root), 4)
    assert latest_checkpoint(str(root)) is None
    _delete(str(root / "missing"))  # nothing to delete: no error


def test_checkpoint_of_another_model_is_refused():
    from types import SimpleNamespace

    mine = model_summary(SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=172,
                                         vocab_size=32, tie_word_embeddings=False))
    assert set(mine) == set(MODEL_SUMMARY_KEYS)
    check_model("/ckpt", dict(mine), mine)
    check_model("/ckpt", None, mine)  # checkpoints from before the summary existed load as before
    other = dict(mine, hidden_size=128, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"checkpoint '/ckpt' was saved for another model \(hidden_size: checkpoint "
                                         r"128 vs model 64, num_hidden_layers: checkpoint 4 vs model 2\).*"
                                         r"trainer.resume_mode=disable"):
        check_model("/ckpt", other, mine)


MANAGER_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
import multiprocessing as mp
from multiprocessing.managers import SyncManager
from parallel.lifetime import die_with_parent

if __name__ == "__main__":
    m = SyncManager(ctx=mp.get_context("spawn"))
    m.start(**({{"initializer": die_with_parent, "initargs": (os.getpid(),)}} if {fixed} else {{}}))
    q = m.Queue()
    print(m._process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # this process alone, like the OOM killer
"""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("fixed", [False, True])
def test_manager_process_dies_with_its_parent(tmp_path, fixed):
    """megatron's save-results Manager (a spawned server process) outlived a killed trainer; started with
    parallel.lifetime.die_with_parent it goes with it.  The unfixed case shows the test can fail."""
    import time

    import psutil

    script = tmp_path / "mgr.py"
    script.write_text(MANAGER_SCRIPT.format(root=ROOT, fixed=fixed))
    with open(tmp_path / "out", "w+") as out:  # a file, not a pipe: an orphan would hold a pipe open
        rc = subprocess.run([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
        out.seek(0)
        text = out.read()
    assert rc == -9, text
    pid = int(text.split()[0])
    # fixed: PR_SET_PDEATHSIG kills it at once (10 s is only a bound); unfixed: alive 3 s after its parent's
    # SIGKILL shows it outlived the parent (it never exits on its own), no need to wait the bound out
    deadline = time.monotonic() + (10 if fixed else 3)
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    survived = _alive(pid)
    if survived:
        psutil.Process(pid).kill()
    assert survived is not fixed


def test_resume_target_for_every_state_a_killed_save_leaves(tmp_path):
    """The states the fault points ckpt_mid_save / ckpt_before_rename / ckpt_before_tracker leave behind (the
    cases the fault matrix no longer runs one by one): each time the tracker's step 1 is resumed."""
    root = tmp_path / "checkpoints"
    (root / "global_step_1").mkdir(parents=True)
    (root / "global_step_1" / "trainer_state.pt").write_text("x")
    _write_tracker(str(root), 1)
    step1 = str(root / "global_step_1")
    (root / "global_step_2.tmp" / "actor").mkdir(parents=True)  # mid save: tensor files, no metadata.json
    (root / "global_step_2.tmp" / "actor" / "__0_0.distcp").write_text("x")
    assert latest_checkpoint(str(root)) == step1
    (root / "global_step_2.tmp" / "trainer_state.pt").write_text("x")  # before the rename: complete, not named
    assert latest_checkpoint(str(root)) == step1
    os.replace(root / "global_step_2.tmp", root / "global_step_2")  # renamed, the tracker not yet written
    assert latest_checkpoint(str(root)) == step1
    _write_tracker(str(root), 2)
    assert latest_checkpoint(str(root)) == str(root / "global_step_2")


def test_trace_logs_every_pass_with_its_context(monkeypatch, caplog):
    monkeypatch.setattr(faults, "_passes", {})
    monkeypatch.delenv("RLHF_FAULT", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("RLHF_FAULT_TRACE", "1")
    with caplog.at_level("WARNING", logger="rlhf.faults"):
        for last in (False, True, False):
            faults.maybe_fail("sync_weights", last=last)
    assert caplog.messages == ["FAULT-TRACE sync_weights 1 last=False", "FAULT-TRACE sync_weights 2 last=True",
                               "FAULT-TRACE sync_weights 3 last=False"]
