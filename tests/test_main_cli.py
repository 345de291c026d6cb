"""`python -m rlhf.main ... algorithm=NAME` expands to the algorithm preset (rlhf.api.ALGORITHMS)."""
import pytest

from rlhf.config.loader import compose_config
from rlhf.main import UsageError, parse_args


def test_algorithm_shorthand_expands_in_place():
    _, overrides = parse_args(["recipe=quickstart", "algorithm=grpo", "critic.enable=true"])
    assert overrides[0] == "recipe=quickstart" and "algorithm.adv_estimator=grpo" in overrides
    assert overrides[-1] == "critic.enable=true"  # later overrides still win
    cfg = compose_config(overrides[1:], recipe="quickstart")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.critic.enable is True
    _, overrides = parse_args(["recipe=quickstart", "algorithm=dpo"])
    assert compose_config(overrides[1:], recipe="quickstart").algorithm.name == "dpo"


def test_unknown_algorithm_names_the_presets():
    with pytest.raises(UsageError, match="algorithm='foo' is not a preset.*'dpo'"):
        parse_args(["algorithm=foo"])
