"""One command on one CPU node, real SGLang engine, the tiny quickstart model:

* verl's one-step-off pool keys (``actor_rollout_ref.hybrid_engine=False``, ``trainer.n_gpus_per_node=1``,
  ``rollout.n_gpus_per_node=1``: verl/experimental/one_step_off_policy) run the engine disaggregated, the trainer's one
  rank started by the command itself (no torchrun arithmetic), every weight sync read back;
* the colocated quickstart saves a checkpoint with its engines released around the save (the memory plan's
  "checkpoint save" phase) and generates again after it on re-synced engines.

A colocated quickstart resuming from such a checkpoint: tests/e2e/test_fault_matrix.py (its last run resumes from
step 2, finishes step 3, and equals an uninterrupted run bitwise)."""
import os

import pytest

from tests.support.dist_utils import finish_group, main_cmd, start_group

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def runs(quickstart_model, tmp_path_factory):
    """{name: (exit code, output, run dir)} of the two runs, one after the other, each in a process group of its own."""
    root, model = tmp_path_factory.mktemp("pools"), quickstart_model(warmup_steps=40)
    jobs = {"pools": ["actor_rollout_ref.hybrid_engine=False", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
                      "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "trainer.total_training_steps=2",
                      "trainer.save_freq=2"],
            "colocated": ["trainer.save_freq=1", "trainer.total_training_steps=2"]}
    rcs = {name: finish_group(start_group(main_cmd([*common(model, root / name), *extra]), root / f"{name}.log",
                                          {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None}), 900)
           for name, extra in jobs.items()}
    return {name: (rcs[name], (root / f"{name}.log").read_text(errors="replace"), root / name) for name in jobs}


def common(tiny_model, out_dir):
    return ["recipe=quickstart", f"model.path={tiny_model}", f"trainer.default_local_dir={out_dir}",
            "trainer.progress_bar=false", "trainer.logger=[console]", "rollout.weight_sync_check=true",
            "trainer.val_before_train=false", "trainer.export_hf_at_end=false"]


def test_verl_one_step_off_pool_keys_run_disaggregated(runs):
    rc, out, run_dir = runs["pools"]
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    assert "[rollout] disaggregated: 1 engine(s)" in out, out[-4000:]
    assert "[rlhf.main] starting" not in out  # trainer.n_gpus_per_node=1: one rank, trains in this process
    assert "step 2:" in out and os.path.isdir(run_dir / "checkpoints" / "global_step_2")


def test_colocated_save_releases_the_engines_and_generates_after_it(runs):
    rc, out, run_dir = runs["colocated"]
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    assert out.count("[rollout] colocated engines released for the checkpoint save") == 2, out[-4000:]
    assert "step 2:" in out  # generated after step 1's save (the generation resumed and synced the engines)
    assert os.path.isdir(run_dir / "checkpoints" / "global_step_2")
