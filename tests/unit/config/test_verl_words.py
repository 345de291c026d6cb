"""Config errors in the user's words: a user of verl's keys reads every problem with the keys as typed and the fixes
in verl's keys (no rlhf-only rollout.num_engines advice); a user of our keys reads ours.  CPU, ``rlhf.main --cfg``
in-process."""
from __future__ import annotations

import re

import pytest

from rlhf.config.verl.compat import Translated
from rlhf.config.verl.words import in_user_words
from rlhf.rollout.placement import job_placement_problem
from tests.support.verl_examples import problems, run_cfg
from tests.unit.config.test_verl_compat import _model_dir


def _standalone(key: str, text: str) -> bool:
    """``key`` appears in ``text`` as a whole key (not inside a longer one such as actor_rollout_ref.<key>)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text) is not None


def test_each_problem_names_the_verl_key_as_typed(gsm8k_row_file, tmp_path):
    """Four real problems of one verl command line (a TP that does not divide the heads, DAPO's overlong buffer
    past the response length, a missing dist checkpoint, a mini batch that does not divide the batch): each line
    names verl's key, and none names ours."""
    model = _model_dir(tmp_path / "qwen")
    code, _, err = run_cfg([f"data.train_files={gsm8k_row_file}", f"actor_rollout_ref.model.path={model}",
                            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                            "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=100000",
                            "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True",
                            f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={tmp_path / 'none'}",
                            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=3"])
    assert code == 2
    text = "\n".join(problems(err))
    for verl in ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                 "reward_model.overlong_buffer.len=100000", "set reward_model.overlong_buffer.len<=",
                 "actor_rollout_ref.actor.megatron.dist_checkpointing_path=",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=3 does not divide data.train_batch_size=8",
                 "such as actor_rollout_ref.actor.ppo_mini_batch_size=2"):
        assert verl in text, (verl, err)
    for ours in ("parallel.tensor_model_parallel_size", "reward.overlong_buffer.len", "actor.dist_checkpointing_path",
                 "actor.ppo_mini_batch_size"):
        assert not _standalone(ours, text), (ours, err)


def test_a_user_of_our_keys_reads_ours(gsm8k_row_file, tmp_path):
    """The same problems given in our keys are named in ours; a verl user's own keys of ours stay as typed."""
    model = _model_dir(tmp_path / "qwen")
    code, _, err = run_cfg([f"data.train_files={gsm8k_row_file}", f"model.path={model}", "parallel.tensor_model_parallel_size=3",
                            "reward.overlong_buffer.enable=True", "reward.overlong_buffer.len=100000"])
    assert code == 2 and "parallel.tensor_model_parallel_size=3" in err and "reward.overlong_buffer.len=100000" in err
    assert "actor_rollout_ref" not in err and "reward_model." not in err
    code, _, err = run_cfg([f"data.train_files={gsm8k_row_file}", f"actor_rollout_ref.model.path={model}",
                            "parallel.tensor_model_parallel_size=3", "actor_rollout_ref.rollout.temperature=-1"])
    assert code == 2 and "parallel.tensor_model_parallel_size=3" in err
    assert "actor_rollout_ref.rollout.temperature=-1.0 must be >= 0" in err


def test_placement_errors_advise_verl_keys_not_rollout_num_engines(gsm8k_row_file):
    """An engine wider than the node, given in verl's keys: the line counts verl's rollout replicas and says which
    verl key to change."""
    code, _, err = run_cfg([f"data.train_files={gsm8k_row_file}", "actor_rollout_ref.model.path=tiny://quickstart",
                            "actor_rollout_ref.rollout.tensor_model_parallel_size=16", "trainer.n_gpus_per_node=8"])
    assert code == 2
    [line] = problems(err)
    assert "rollout.num_engines" not in line and "rollout.mode=" not in line, line
    assert "1 rollout replica(s) (colocated) x actor_rollout_ref.rollout.tensor_model_parallel_size=16" in line
    assert "set actor_rollout_ref.rollout.tensor_model_parallel_size to 8 or less" in line


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_engine_count_fixes_become_verl_keys(mode):
    """The placement's 'lower rollout.num_engines ...' fixes (rlhf/rollout/placement.py, as the config check words
    them) read for a verl user as the verl keys that set the replica count; a user who typed rollout.num_engines
    keeps it."""
    text = job_placement_problem(mode=mode, num_engines=4, engine_tp=2, gpus_per_node=4,
                                 trainer_world_size=4 if mode == "colocated" else None)
    assert "lower rollout.num_engines" in text
    verl = Translated(speaks_verl=True, typed={"rollout.tensor_model_parallel_size":
                                               "actor_rollout_ref.rollout.tensor_model_parallel_size"})
    said = in_user_words(text, verl)
    assert "rollout.num_engines" not in said and "actor_rollout_ref.rollout.tensor_model_parallel_size" in said, said
    assert "trainer.n_gpus_per_node" in said
    verl.own.add("rollout.num_engines")
    assert "lower rollout.num_engines" in in_user_words(text, verl)
    assert in_user_words(text, Translated()) == text
