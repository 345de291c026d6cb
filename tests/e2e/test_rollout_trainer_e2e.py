"""The rollout seam through the trainer (`python -m rlhf.main`, CPU, real SGLang engine): an engine killed between
steps is replaced, re-synced with the latest weights before it generates (the read-back check passes after the
re-sync), and the run completes with the restart counted.

Disaggregated mode through the trainer (2 trainer ranks at TP2 broadcasting into the engine's weight-update group,
every sync read back with `rollout.weight_sync_check`) runs in tests/e2e/test_ray_cluster_local.py (engine on the other
node) and tests/e2e/test_slurm_local.py.
"""
import re
import threading
import time

import psutil
import pytest

from tests.support.dist_utils import finish_group, main_cmd, start_group
from tests.support.tracking_readers import run_scalars as scalars

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf.quickstart.model import build_quickstart_model

    return build_quickstart_model(str(tmp_path_factory.mktemp("tiny") / "model"), warmup_steps=20)


def overrides(model, out, steps):
    return ["recipe=quickstart", f"model.path={model}", f"trainer.default_local_dir={out}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=12",
            "rollout.weight_sync_check=true", "trainer.export_hf_at_end=false"]


def launch(args, nproc, log_path):
    return start_group(main_cmd(args, nproc), log_path)


def finish(proc, log_path, timeout=1500):
    rc = finish_group(proc, timeout)
    out = open(log_path).read()
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    return out


def test_engine_killed_between_steps_is_resynced_before_it_generates(tiny_model, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log"
    proc = launch(overrides(tiny_model, out, 3), 1, log)
    killed = {}

    def kill_after_step_one():
        deadline = time.time() + 1200
        while time.time() < deadline and proc.poll() is None:
            if re.search(r"(^|: )step 1: ", open(log).read(), re.M):  # the metrics line of step 1
                for p in psutil.process_iter(["pid", "cmdline"]):
                    if "SGLangEngine" in " ".join(p.info["cmdline"] or []) and p.pid not in killed:
                        killed[p.pid] = True
                        p.kill()
                return
            time.sleep(0.5)

    th = threading.Thread(target=kill_after_step_one)
    th.start()
    text = finish(proc, log)
    th.join()
    assert killed, "the engine was not found to kill"
    assert "rollout engine 0 died" in text or "starting a new one" in text, text[-3000:]
    s = scalars(out)
    assert s[("rollout/num_restarts", 3)] == 1
    assert ("critic/score/mean", 3) in s  # steps after the restart generated (on re-synced weights: checked)


def test_critic_warmup_step_then_validation_colocated(tiny_model, tmp_path):
    """Step 1 is a critic warm-up step (the actor is not updated, nothing is synced): the colocated engine released
    its weights during training and SGLang's memory saver keeps no copy, so the validation right after it syncs
    first (PPOTrainer.validate -> RolloutWorker.ensure_resident: weights resumed and pushed, KV cache resumed), and
    step 2 generates on synced weights (the manager refuses resumed-but-unsynced weights:
    rlhf.rollout.manager.WeightsDiscardedError).  Without it this validation raised."""
    out, log = tmp_path / "run", tmp_path / "log"
    changed = ["trainer.critic_warmup=1", "trainer.test_freq=1", "data.max_val_samples=4", "data.val_batch_size=4",
               "rollout.weight_sync_check=false"]
    keys = {c.split("=")[0] for c in changed}
    args = [a for a in overrides(tiny_model, out, 2) if a.split("=")[0] not in keys] + changed
    finish(launch(args, 1, log), log, timeout=900)
    s = scalars(out)
    assert ("actor/pg_loss", 1) not in s and ("critic/vf_loss", 1) in s  # step 1 trained only the critic
    assert ("actor/pg_loss", 2) in s
    assert ("val/score", 1) in s and ("val/score", 2) in s  # validation right after the warm-up step, and after 2
    assert ("timing_s/sync_weights", 1) not in s  # the warm-up step syncs nothing; the validation after it does
