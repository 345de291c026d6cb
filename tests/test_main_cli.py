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
