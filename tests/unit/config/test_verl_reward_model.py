"""A verl reward model (reward_model.enable, with verl's GPU settings reward_model.rollout.*) scores on the CPU here:
``--cfg`` (and every start, which composes the same way) says so in one loud line naming verl's settings that have
no effect.  CPU, in-process."""
from __future__ import annotations

import logging

from tests.support.verl_examples import run_cfg
from tests.unit.config.test_verl_compat import _model_dir


def test_verl_reward_model_on_gpu_settings_get_a_loud_line(gsm8k_row_file, tmp_path, caplog):
    rm = _model_dir(tmp_path / "rm")
    base = [f"data.train_files={gsm8k_row_file}", "actor_rollout_ref.model.path=tiny://quickstart"]
    with caplog.at_level(logging.WARNING, logger="rlhf.config"):
        code, _, err = run_cfg([*base, "reward_model.enable=True", f"reward_model.model.path={rm}",
                                "reward_model.rollout.tensor_model_parallel_size=2",
                                "reward_model.rollout.gpu_memory_utilization=0.5"])
    assert code == 0, err
    [line] = [r.getMessage() for r in caplog.records if "REWARD MODEL ON CPU" in r.getMessage()]
    assert f"reward.sources[0] (the reward model {rm}) scores on the CPU, in a Ray worker of its own" in line
    assert "reward_model.rollout.gpu_memory_utilization, reward_model.rollout.tensor_model_parallel_size given: no " \
           "effect here" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf.config"):
        assert run_cfg(base)[0] == 0
    assert not any("REWARD MODEL" in r.getMessage() for r in caplog.records)  # no reward model: no line
