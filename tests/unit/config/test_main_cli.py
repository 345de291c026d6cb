"""`python -m rlhf.main ... algorithm=NAME` selects the algorithm preset rlhf/config/algorithm/NAME.yaml (a Hydra
config group applied on top of the recipe; key=value overrides still win)."""
import pytest

from rlhf.config import compose_config
from rlhf.main import UsageError, parse_args


def test_algorithm_preset_on_the_command_line():
    _, overrides = parse_args(["recipe=quickstart", "algorithm=grpo", "critic.enable=true"])
    assert overrides == ["recipe=quickstart", "algorithm=grpo", "critic.enable=true"]
    cfg = compose_config(overrides[1:], recipe="quickstart")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.critic.enable is True  # the override wins over the preset
    assert cfg.rollout.n == 4  # quickstart's
    _, overrides = parse_args(["recipe=quickstart", "+algorithm=dpo"])
    assert overrides[1] == "algorithm=dpo"
    assert compose_config(overrides[1:], recipe="quickstart").algorithm.name == "dpo"
    # the algorithm.* keys are still set as usual next to a preset
    cfg = compose_config(["algorithm=grpo", "algorithm.adv_estimator=rloo"])
    assert (cfg.algorithm.adv_estimator, cfg.critic.enable, cfg.rollout.n) == ("rloo", None, 4)


def test_unknown_algorithm_names_the_presets():
    with pytest.raises(UsageError, match="algorithm='foo' is not a preset.*'dpo'"):
        parse_args(["algorithm=foo"])


def test_launch_env_reads_torchrun_then_slurm():
    from rlhf.launch_env import LaunchEnv, launch_env
    from parallel.distributed import detect_launch_env

    cases = [({}, LaunchEnv(0, None, 0, "single")),
             ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, LaunchEnv(3, 8, 1, "torchrun")),
             ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, LaunchEnv(5, 16, 1, "slurm")),
             ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "9", "SLURM_NTASKS": "16"},
              LaunchEnv(1, 2, 0, "torchrun")),
             ({"RANK": "1"}, LaunchEnv(0, None, 0, "single"))]  # torchrun always sets both
    for env, expected in cases:
        assert launch_env(env) == expected
        mc = detect_launch_env({**env, "SLURM_JOB_NODELIST": "n1"})  # the same rules as the process-group set-up
        assert (mc.rank, mc.world_size, mc.local_rank) == (expected.rank, expected.world_size or 1, expected.local_rank)


def test_option_values_are_parsed_as_hydra_would(capsys):
    """Hydra's argument parser: a bare --cfg / --plan-memory leaves the next override alone; --cfg takes only
    Hydra's job/hydra/all (a typo is refused, not read as job); options and overrides mix in any order; one
    --config-dir, as Hydra's (before: several were collected)."""
    opts, overrides = parse_args(["a.b=1", "--cfg", "c.d=2", "--plan-memory", "-cd", "/x", "e.f=3", "-cd", "/y"])
    assert overrides == ["a.b=1", "c.d=2", "e.f=3"] and opts["cfg"] and opts["plan_memory"] == "auto"
    assert opts["config_dirs"] == ["/y"] and opts["hydra"] == ["--resolve", "--cfg=job", "--config-dir=/y"]
    assert parse_args(["--print-launch=8", "--cfg", "all"])[0]["print_launch"] == 8
    from rlhf.main import main

    assert main(["recipe=quickstart", "--cfg=bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
