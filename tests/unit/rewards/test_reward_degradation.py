"""Reward degradation: a source that fails on a sample
(error, timeout, None, NaN, +-inf) gives it the configured fallback (the data source's rule reward, a
static length/keyword score, or a constant), counted per source; samples nothing could score are
flagged in the validity mask of RewardManager.score(..., return_valid=True)."""
from __future__ import annotations

import math
import time

import pytest
from omegaconf import OmegaConf

from rlhf.config.schema import RewardConfig
from rlhf.rewards import Fallback, RewardManager, RewardSource, build_reward_manager, check_reward_config
from rlhf.rewards.registry import _unregister, call_reward_fn, compute_scores, register_reward_fn


@pytest.fixture
def bad_rewards():
    names = {"t/inf": math.inf, "t/-inf": -math.inf, "t/nan": math.nan}
    for name, value in names.items():
        register_reward_fn(name)(lambda solution_str, ground_truth, v=value: v)
    register_reward_fn("t/none")(lambda solution_str, ground_truth: None)
    yield list(names) + ["t/none"]
    _unregister(*names, "t/none")


def test_non_finite_and_none_rewards_are_failures(bad_rewards):
    for name in bad_rewards:
        with pytest.raises((ValueError, TypeError)):
            call_reward_fn(__import__("rlhf").rewards.get_reward_fn(name), name, "x", "1")
    scores, n = compute_scores(bad_rewards + ["gsm8k"], ["x", "x", "x", "x", "#### 1"], ["1"] * 5, fallback_score=-0.5)
    assert scores == [-0.5, -0.5, -0.5, -0.5, 1.0] and n == 4
    rm = RewardManager([RewardSource("rule")], fallback=Fallback("constant", 0.25))
    scores, m, valid = rm.score(["x", "x", "x", "x", "#### 1"], bad_rewards + ["gsm8k"], ["1"] * 5, return_valid=True)
    assert scores == [0.25, 0.25, 0.25, 0.25, 1.0]
    assert valid == [False, False, False, False, True]
    assert m["reward/num_fallbacks"] == 4 and m["reward/rule/num_fallbacks"] == 4 and m["reward/num_unscorable"] == 4
    assert len(rm.score(["#### 1"], ["gsm8k"], ["1"])) == 2  # (scores, metrics) without return_valid


class _Model:
    """A reward model stand-in: 0.7 per pair; slow (5 s) or raising on a response containing 'slow' / 'boom'."""

    def __init__(self):
        self.calls = []

    def score(self, prompts, responses):
        self.calls.append(len(responses))
        if any("boom" in r for r in responses):
            raise RuntimeError("CUDA error: an illegal memory access")
        if any("slow" in r for r in responses):
            time.sleep(5)
        return [0.7] * len(responses)


def test_slow_or_failing_model_degrades_to_the_rule_reward_per_micro_batch():
    model = _Model()
    rm = RewardManager([RewardSource("model", 2.0, scorer=model, chunk_size=2)], timeout_s=0.5,
                       fallback=Fallback("rule", 0.0))
    responses = ["#### 4", "#### 5", "slow #### 4", "#### 9", "boom #### 3", "x"]
    t0 = time.monotonic()
    scores, m, valid = rm.score(responses, ["gsm8k"] * 6, ["4", "4", "4", "4", "3", "3"], return_valid=True)
    assert time.monotonic() - t0 < 3.0  # the 5 s call is abandoned after 0.5 s
    assert model.calls == [2, 2, 2]  # one call per micro batch of 2
    # micro batch 1 scored by the model (0.7 each); 2 timed out and 3 raised: the GSM8K rule reward instead
    assert scores == [2 * 0.7, 2 * 0.7, 2 * 1.0, 2 * 0.0, 2 * 1.0, 2 * 0.0]
    assert valid == [True] * 6  # the rule fallback scored them
    assert m["reward/num_fallbacks"] == 4 and m["reward/model/num_fallbacks"] == 4 and m["reward/num_unscorable"] == 0


def test_static_fallback_hand_values_and_unscorable():
    fb = Fallback("static", 0.1, keywords=["####", "answer"], keyword_score=0.5, length_penalty=0.01, max_chars=10)
    assert fb.static("short") == pytest.approx(0.1)
    assert fb.static("the answer") == pytest.approx(0.6)  # 10 chars: no penalty
    assert fb.static("x" * 30) == pytest.approx(0.1 - 0.01 * 20)
    assert fb.static("#### 12" + "y" * 13) == pytest.approx(0.1 + 0.5 - 0.01 * 10)
    model = _Model()
    rm = RewardManager([RewardSource("model", 1.0, scorer=model)], timeout_s=5, fallback=fb)
    scores, m, valid = rm.score(["boom " + "x" * 25, "boom the answer"], ["gsm8k"] * 2, ["1", "1"], return_valid=True)
    assert scores == pytest.approx([0.1 - 0.01 * 20, 0.6 - 0.01 * 5])
    assert valid == [False, False]  # a static score is not a score of the sample
    assert m["reward/num_unscorable"] == 2


def test_partial_failure_keeps_the_sample_valid():
    def custom(solution_str, ground_truth):
        if "boom" in solution_str:
            raise ValueError("judge unavailable")
        return 0.5

    rm = RewardManager([RewardSource("rule", 1.0), RewardSource("custom", 2.0, fn=custom)],
                       fallback=Fallback("constant", -1.0))
    scores, m, valid = rm.score(["#### 1", "boom #### 1"], ["gsm8k"] * 2, ["1", "1"], return_valid=True)
    assert scores == [1.0 + 2 * 0.5, 1.0 + 2 * -1.0]
    assert valid == [True, True]
    assert m["reward/custom/num_fallbacks"] == 1 and m["reward/rule/num_fallbacks"] == 0
    assert m["reward/num_fallbacks"] == 1 and m["reward/num_unscorable"] == 0
    assert m["reward/custom/mean"] == pytest.approx((0.5 - 1.0) / 2)


def test_rule_fallback_of_a_failing_rule_source_is_static():
    register_reward_fn("t/flaky")(lambda solution_str, ground_truth: 1 / 0)
    try:
        rm = RewardManager([RewardSource("rule")], fallback=Fallback("rule", 0.3))
        scores, m, valid = rm.score(["x"], ["t/flaky"], ["1"], return_valid=True)
        assert scores == [0.3] and valid == [False] and m["reward/num_unscorable"] == 1
    finally:
        _unregister("t/flaky")


def _cfg(sources=(), **kw):
    from rlhf.config.schema import RewardSourceConfig

    cfg = OmegaConf.structured(RewardConfig)
    cfg.sources = [OmegaConf.merge(OmegaConf.structured(RewardSourceConfig), s) for s in sources]
    for k, v in kw.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def test_config_defaults_and_fallback_from_config():
    cfg = OmegaConf.structured(RewardConfig)
    assert cfg.timeout_s == 3.0 and cfg.fallback.type == "rule" and cfg.exclude_unscorable is True
    rm = build_reward_manager(_cfg(**{"fallback.type": "static", "fallback.keywords": ["ok"],
                                      "fallback.keyword_score": 0.2, "fallback_score": 0.05}))
    assert rm.timeout_s == 3.0 and rm.fallback == Fallback("static", 0.05, ["ok"], 0.2, 0.0, None)
    with pytest.raises(ValueError, match="type='judge'"):
        Fallback("judge")


def test_reward_file_raising_on_import_is_named_before_training(tmp_path):
    bad = tmp_path / "my_reward.py"
    bad.write_text("import no_such_module_xyz\n\ndef compute_score(solution_str, ground_truth):\n    return 1.0\n")
    cfg = _cfg(**{"custom_reward_function.path": str(bad)})
    with pytest.raises(ImportError, match=r"my_reward\.py.*failed: ModuleNotFoundError: No module named "
                                          r"'no_such_module_xyz'"):
        check_reward_config(cfg)
    cfg = _cfg(sources=[{"type": "custom", "path": str(bad)}])
    with pytest.raises(ImportError, match="my_reward.py"):
        check_reward_config(cfg)
    check_reward_config(_cfg())  # no custom file: nothing to load


def test_in_process_reward_callable_is_resolved():
    from rlhf.config.objects import register_object

    uri = register_object(lambda data_source, solution_str, ground_truth, extra_info=None: 0.125, "reward")
    rm = build_reward_manager(_cfg(sources=[{"type": "custom", "path": uri}]))
    assert rm.score(["a"], ["any"], [None])[0] == [0.125]


def test_gsm8k_method_and_format_score_from_the_config():
    """reward.gsm8k.{method,format_score} reach the GSM8K rule (they had no effect before)."""
    responses, gts = ["so the answer is 42", "#### 41", "#### 42"], ["42", "42", "42"]
    strict = build_reward_manager(_cfg())
    assert strict.score(responses, ["openai/gsm8k"] * 3, gts)[0] == [0.0, 0.0, 1.0]
    flexible = build_reward_manager(_cfg(**{"gsm8k.method": "flexible", "gsm8k.format_score": 0.1}))
    assert flexible.score(responses, ["openai/gsm8k"] * 3, gts)[0] == [1.0, 0.1, 1.0]
    assert flexible.score(responses, ["gsm8k"] * 3, gts)[0] == [1.0, 0.1, 1.0]
    # other data sources keep their registered rule; the rule fallback of a failed model source follows the config
    assert flexible.score(["so the answer is 42"], ["synthetic/arithmetic"], ["42"])[0] == [0.0]
    rm = RewardManager([RewardSource("model", 1.0, scorer=_Model())], fallback=flexible.fallback)
    assert rm.score(["boom: the answer is 42"], ["openai/gsm8k"], ["42"], return_valid=True)[::2] == ([1.0], [True])
