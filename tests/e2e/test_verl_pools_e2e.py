"""One command on one CPU node, real SGLang engine, the tiny quickstart model:

* verl's one-step-off pool keys (``actor_rollout_ref.hybrid_engine=False``, ``trainer.n_gpus_per_node=1``,
  ``rollout.n_gpus_per_node=1``: verl/experimental/one_step_off_policy) run the engine disaggregated, the trainer's one
  rank started by the command itself (no torchrun arithmetic), every weight sync read back;
* the colocated quickstart saves a checkpoint with its engines released around the save (the memory plan's
  "checkpoint save" phase), generates again after it on re-synced engines, and a second run resumes from it."""
import os

import pytest

from tests.support.dist_utils import main_cmd, run_group

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf.quickstart.model import build_quickstart_model

    return build_quickstart_model(str(tmp_path_factory.mktemp("tiny") / "model"), warmup_steps=40)


def run(overrides, timeout=900):
    rc, out = run_group(main_cmd(overrides), timeout, {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None})
    assert rc == 0, f"exit {rc}:\n{out[-6000:]}"
    return out


def common(tiny_model, out_dir):
    return ["recipe=quickstart", f"model.path={tiny_model}", f"trainer.default_local_dir={out_dir}",
            "trainer.progress_bar=false", "trainer.logger=[console]", "rollout.weight_sync_check=true",
            "trainer.val_before_train=false", "trainer.export_hf_at_end=false"]


def test_verl_one_step_off_pool_keys_run_disaggregated(tiny_model, tmp_path):
    out = run([*common(tiny_model, tmp_path / "pools"), "actor_rollout_ref.hybrid_engine=False",
               "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
               "trainer.total_training_steps=2", "trainer.save_freq=2"])
    assert "[rollout] disaggregated: 1 engine(s)" in out, out[-4000:]
    assert "[rlhf.main] starting" not in out  # trainer.n_gpus_per_node=1: one rank, trains in this process
    assert "step 2:" in out and os.path.isdir(tmp_path / "pools" / "checkpoints" / "global_step_2")


def test_colocated_save_releases_the_engines_and_the_run_resumes(tiny_model, tmp_path):
    args = [*common(tiny_model, tmp_path / "run"), "trainer.save_freq=1"]
    first = run([*args, "trainer.total_training_steps=2"])
    assert first.count("[rollout] colocated engines released for the checkpoint save") == 2, first[-4000:]
    assert "step 2:" in first  # generated after step 1's save (the generation resumed and synced the engines)
    second = run([*args, "trainer.total_training_steps=3"])
    assert "at step 2" in second and "step 3:" in second, second[-4000:]
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "global_step_3")
