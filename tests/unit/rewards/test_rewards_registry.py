"""Reward registry: lookup, errors, custom-fn loading, and fallback on errors/timeouts."""

import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rlhf.rewards import (  # noqa: E402
    RewardModelScorer,
    compute_scores,
    get_reward_fn,
    load_custom_reward_fn,
    register_reward_fn,
    registered_data_sources,
)
from rlhf.rewards import registry as reg  # noqa: E402


@pytest.fixture
def scratch_names():
    names = []
    yield names
    reg._unregister(*names)


def test_builtin_sources_map_to_strict_gsm8k():
    for ds in ("openai/gsm8k", "gsm8k", "synthetic/arithmetic"):
        fn = get_reward_fn(ds)
        assert fn is get_reward_fn("openai/gsm8k")
        assert reg.call_reward_fn(fn, ds, "x\n#### 1,000", "1000") == 1.0
        assert reg.call_reward_fn(fn, ds, "#### 7\n#### 8", "8") == 0.0  # first #### wins
    assert {"openai/gsm8k", "gsm8k", "synthetic/arithmetic"} <= set(registered_data_sources())


def test_unknown_data_source_keyerror_names_it_and_registered():
    with pytest.raises(KeyError) as ei:
        get_reward_fn("nope/unknown")
    msg = str(ei.value)
    assert "nope/unknown" in msg and "openai/gsm8k" in msg and "synthetic/arithmetic" in msg
    with pytest.raises(KeyError, match="nope/unknown"):
        compute_scores(["gsm8k", "nope/unknown"], ["#### 1", "#### 2"], ["1", "2"])


def test_register_decorator_and_duplicate(scratch_names):
    scratch_names += ["test/len", "test/len2"]

    @register_reward_fn("test/len", "test/len2")
    def length_reward(solution_str, ground_truth, extra_info=None):
        return len(solution_str) + (extra_info or {}).get("bonus", 0)

    assert get_reward_fn("test/len") is length_reward
    assert get_reward_fn("test/len2") is length_reward
    # re-registering the same fn is fine; a different one needs overwrite=True
    register_reward_fn("test/len")(length_reward)
    with pytest.raises(ValueError, match="test/len"):
        register_reward_fn("test/len")(lambda solution_str, ground_truth: 0.0)
    register_reward_fn("test/len", overwrite=True)(lambda solution_str, ground_truth: 0.5)
    assert get_reward_fn("test/len")("abc", None) == 0.5
    with pytest.raises(ValueError):
        register_reward_fn()
    with pytest.raises(TypeError):
        register_reward_fn("")


def test_compute_scores_mixed_sources_and_extra_info(scratch_names):
    scratch_names.append("test/len")
    register_reward_fn("test/len")(lambda solution_str, ground_truth, extra_info=None: len(solution_str) + extra_info["b"])
    scores, nfb = compute_scores(
        ["gsm8k", "test/len", "openai/gsm8k"],
        ["#### 72", "abcd", "#### 71"],
        ["72", None, "72"],
        extra_infos=[{}, {"b": 10}, {}],
    )
    assert scores == [1.0, 14.0, 0.0] and nfb == 0
    # same result with a thread pool
    scores2, nfb2 = compute_scores(
        ["gsm8k", "test/len", "openai/gsm8k"], ["#### 72", "abcd", "#### 71"], ["72", None, "72"],
        extra_infos=[{}, {"b": 10}, {}], timeout_s=5.0,
    )
    assert scores2 == scores and nfb2 == 0
    assert compute_scores([], [], []) == ([], 0)
    with pytest.raises(ValueError, match="length mismatch"):
        compute_scores(["gsm8k"], ["a", "b"], ["1", "2"])
    with pytest.raises(ValueError, match="timeout_s"):
        compute_scores(["gsm8k"], ["a"], ["1"], timeout_s=0)


def test_load_custom_reward_fn(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(textwrap.dedent("""
        CONST = 3
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str == ground_truth) + CONST, "acc": 1}
        def other(solution_str, **kwargs):
            return kwargs["data_source"] == "ds"
    """))
    fn = load_custom_reward_fn(f, "compute_score")
    scores, nfb = compute_scores(["anything", "anything"], ["a", "b"], ["a", "a"], reward_fn=fn)
    assert scores == [4.0, 3.0] and nfb == 0
    other = load_custom_reward_fn(str(f), "other")
    assert compute_scores(["ds", "x"], ["", ""], [None, None], reward_fn=other) == ([1.0, 0.0], 0)

    with pytest.raises(AttributeError) as ei:
        load_custom_reward_fn(f, "missing_fn")
    assert "missing_fn" in str(ei.value) and "my_reward.py" in str(ei.value) and "compute_score" in str(ei.value)
    with pytest.raises(FileNotFoundError, match="does_not_exist.py"):
        load_custom_reward_fn(tmp_path / "does_not_exist.py")
    with pytest.raises(TypeError, match="CONST"):
        load_custom_reward_fn(f, "CONST")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ImportError, match="boom"):
        load_custom_reward_fn(bad)


def test_exception_and_bad_return_fallback(scratch_names):
    scratch_names += ["test/raise", "test/str", "test/nan"]

    @register_reward_fn("test/raise")
    def raises(solution_str, ground_truth):
        if solution_str == "bad":
            raise RuntimeError("reward exploded")
        return 1.0

    register_reward_fn("test/str")(lambda solution_str, ground_truth: "not a number")
    register_reward_fn("test/nan")(lambda solution_str, ground_truth: float("nan"))

    for timeout in (None, 1.0):
        scores, nfb = compute_scores(
            ["test/raise", "test/raise", "test/str", "test/nan", "gsm8k"],
            ["ok", "bad", "x", "x", "#### 5"],
            [None, None, None, None, "five"],  # gsm8k with a non-numeric ground truth raises
            timeout_s=timeout, fallback_score=-1.0,
        )
        assert scores == [1.0, -1.0, -1.0, -1.0, -1.0]
        assert nfb == 4


def test_timeout_fallback_counts_and_does_not_hang(scratch_names):
    scratch_names += ["test/slow"]
    release = threading.Event()

    @register_reward_fn("test/slow")
    def slow(solution_str, ground_truth):
        if solution_str == "hang":
            release.wait(10.0)  # far longer than the timeout
        return 0.5

    t0 = time.monotonic()
    scores, nfb = compute_scores(
        ["test/slow"] * 6, ["fast", "hang", "fast", "hang", "fast", "fast"], [None] * 6,
        timeout_s=0.2, fallback_score=0.0, max_workers=2,  # both workers get stuck once
    )
    elapsed = time.monotonic() - t0
    release.set()
    assert scores == [0.5, 0.0, 0.5, 0.0, 0.5, 0.5]
    assert nfb == 2
    assert elapsed < 2.0


def test_infinite_loop_fn_is_abandoned(scratch_names):
    scratch_names += ["test/spin"]
    stop = threading.Event()

    @register_reward_fn("test/spin")
    def spin(solution_str, ground_truth):
        while not stop.is_set():  # busy loop (pure python, releases the GIL periodically)
            pass
        return 1.0

    t0 = time.monotonic()
    scores, nfb = compute_scores(["test/spin"], ["x"], [None], timeout_s=0.2, fallback_score=0.25)
    assert (scores, nfb) == ([0.25], 1)
    assert time.monotonic() - t0 < 2.0
    stop.set()


def test_reward_model_scorer_interface():
    class Const(RewardModelScorer):
        def score(self, prompts, responses):
            return [float(len(r)) for r in responses]

    s = Const()
    assert s(["p1", [{"role": "user", "content": "q"}]], ["ab", "c"]) == [2.0, 1.0]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        s(["a", "b"], ["x"])

    class Duck:
        def score(self, prompts, responses):
            return [0.0] * len(prompts)

    assert isinstance(Duck(), RewardModelScorer)
    assert not isinstance(object(), RewardModelScorer)
    with pytest.raises(TypeError):
        RewardModelScorer()

    class Bad(RewardModelScorer):
        def score(self, prompts, responses):
            return [float("inf")]

    with pytest.raises(ValueError, match="non-finite"):
        Bad()(["p"], ["r"])


# --------------------------------------------------------------------------- rlhf/rewards/timeout.py


def test_call_with_timeout_value_error_and_limit():
    from rlhf.rewards.timeout import call_with_timeout

    assert call_with_timeout(lambda: 3, 1.0) == 3
    me = threading.get_ident()
    assert call_with_timeout(threading.get_ident, None) == me  # no limit: called in this thread
    assert call_with_timeout(threading.get_ident, 1.0) != me
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, 1.0)
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout_s=0.2"):
        call_with_timeout(lambda: release.wait(10.0), 0.2)
    assert time.monotonic() - t0 < 2.0
    release.set()


def test_run_with_timeouts_results_and_abandoned():
    from rlhf.rewards.timeout import run_with_timeouts

    release = threading.Event()

    def run(i):
        if i == 1:
            release.wait(10.0)
        if i == 2:
            raise KeyError("k")
        return i * 10

    t0 = time.monotonic()
    results, timed_out = run_with_timeouts(run, 4, 0.2, max_workers=2)
    assert time.monotonic() - t0 < 2.0
    release.set()
    assert timed_out == {1}
    assert results[0] == (True, 0) and results[3] == (True, 30)
    assert results[2][0] is False and isinstance(results[2][1], KeyError)
    assert run_with_timeouts(run, 0, 1.0) == ({}, set())
    with pytest.raises(ValueError, match="timeout_s"):
        run_with_timeouts(run, 1, 0)
