"""Rollout fault tolerance: a failed sample is regenerated greedily, alone,
the batch goes on, counted in rollout/num_fallbacks; plus the error-injecting fault points
(rollout_request_error in the engine, reward_model_slow in the local reward model).  Fast, CPU, no engine:
the engine-backed run is tests/e2e/test_fault_matrix.py (its reference run shows the counters in TensorBoard)."""
from __future__ import annotations

import math
import time

import pytest

from rlhf import faults
from rlhf.rollout.fallback import failed_samples, greedy_retry_sampling, merge_retries, sample_failure
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import RolloutSample


def _s(p, j, ids, lps=None, reason="stop", version=3):
    return RolloutSample([9, p], list(ids), list(lps if lps is not None else [-0.5] * len(ids)), reason, p, j,
                         version)


def test_failure_kinds():
    assert sample_failure(_s(0, 0, [4, 2])) is None
    assert sample_failure(_s(0, 0, [4, 2], reason="length")) is None
    assert sample_failure(_s(0, 0, [], reason="abort")) == "abort"
    assert sample_failure(_s(0, 0, [])) == "empty"
    assert sample_failure(_s(0, 0, [4, 2], [-0.1, math.nan])) == "non-finite log-prob"
    assert sample_failure(_s(0, 0, [4], [-math.inf])) == "non-finite log-prob"


def test_failed_samples_are_replaced_in_place_and_counted(caplog):
    """Two prompts x n=2; samples 1 (aborted) and 2 (empty) fail.  The retry gives prompt 0 -> [7, 2] and
    prompt 1 -> aborted again: both replaced (indices kept), num_fallbacks = 2, num_failed_samples = 1."""
    samples = [_s(0, 0, [5, 2]), _s(0, 1, [], reason="abort"), _s(1, 0, []), _s(1, 1, [6, 6, 2])]
    bad = failed_samples(samples)
    assert bad == [1, 2]
    # what the worker hands to the engines: the failed samples' prompts, greedy, one each
    train = SamplingConfig(n=2, temperature=0.8, top_p=0.9, top_k=5, max_new_tokens=7, stop_token_ids=[2], seed=11)
    g = greedy_retry_sampling(train)
    assert (g.n, g.temperature, g.top_p, g.top_k, g.seed, g.max_new_tokens, g.stop_token_ids) == \
        (1, 0.0, 1.0, -1, None, 7, [2])
    retried = [RolloutSample([9, 0], [7, 2], [-0.25, -0.125], "stop", 0, 0, 4),  # prompt_index relative to the retry
               RolloutSample([9, 1], [], [], "abort", 1, 0, 4)]
    with caplog.at_level("WARNING", logger="rlhf.rollout"):
        m = merge_retries(samples, bad, retried)
    assert m == {"rollout/num_fallbacks": 2.0, "rollout/num_failed_samples": 1.0}
    # the fallback is logged once for the batch: how many, why, how many failed again
    assert [r.getMessage() for r in caplog.records] == [
        "rollout: 2 of 4 samples failed (1 abort, 1 empty) and were regenerated greedily; 1 failed again "
        "(rollout/num_fallbacks, rollout/num_failed_samples)"]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert samples[1].response_ids == [7, 2] and samples[1].response_log_probs == [-0.25, -0.125]
    assert samples[1].weight_version == 4 and samples[1].extra == {"rollout_fallback": "abort"}
    assert samples[2].extra == {"rollout_fallback": "empty", "rollout_failed": True}
    assert samples[0].response_ids == [5, 2] and samples[3].response_ids == [6, 6, 2]  # untouched
    with pytest.raises(ValueError, match="1 retried samples for 2 failed"):
        merge_retries(samples, bad, retried[:1])


class _Worker:
    """RolloutWorker._retry_failed on one rank: its _generate answers from a queue (records its calls)."""

    def __init__(self, answers):
        self.rank0, self.answers, self.calls, self.host_group = True, list(answers), [], None

    def _generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        return self.answers.pop(0)


def test_worker_retries_only_failed_samples(monkeypatch):
    from rlhf.workers import rollout as wr

    monkeypatch.setattr(wr, "_broadcast", lambda obj, group: obj)  # one rank
    train = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4)
    w = _Worker([[RolloutSample([9, 1], [8, 2], [-1.0, -1.0], "stop", 0, 0)]])
    samples = [_s(0, 0, [5]), _s(0, 1, [5]), _s(1, 0, [5]), _s(1, 1, [], reason="abort")]
    out, m = wr.RolloutWorker._retry_failed(w, samples, train)
    assert m == {"rollout/num_fallbacks": 1.0, "rollout/num_failed_samples": 0.0}
    assert len(w.calls) == 1 and w.calls[0][0] == [[9, 1]] and w.calls[0][1].temperature == 0.0
    assert out[3].response_ids == [8, 2] and (out[3].prompt_index, out[3].sample_index) == (1, 1)
    w2 = _Worker([])  # nothing failed: no second generation, zero counters (so TensorBoard shows the tag)
    out, m = wr.RolloutWorker._retry_failed(w2, samples, train)
    assert w2.calls == [] and m == {"rollout/num_fallbacks": 0.0, "rollout/num_failed_samples": 0.0}


def test_error_injecting_fault_points(monkeypatch, caplog):
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("RLHF_FAULT", "rollout_request_error@3,reward_model_slow@2")
    monkeypatch.setenv("RLHF_FAULT_STALL_S", "0.3")
    monkeypatch.delenv("RANK", raising=False)
    assert [faults.fires("rollout_request_error") for _ in range(5)] == [False, False, True, False, False]
    t0 = time.monotonic()
    faults.maybe_stall("reward_model_slow")
    assert time.monotonic() - t0 < 0.2
    with caplog.at_level("WARNING", logger="rlhf.faults"):
        faults.maybe_stall("reward_model_slow")
    assert time.monotonic() - t0 >= 0.3
    assert caplog.messages == ["FAULT reward_model_slow hit 2: stall 0.3 s"]
    monkeypatch.delenv("RLHF_FAULT")
    assert not faults.fires("rollout_request_error")


def test_engine_turns_the_injected_request_into_an_aborted_sample(monkeypatch):
    """SGLangEngine.generate with a stand-in sglang.Engine: request 2 of 3 comes back aborted with no token."""
    from rlhf.rollout.sglang_engine import SGLangEngine

    class _Sgl:
        def generate(self, input_ids, sampling_params, return_logprob, lora_path=None):
            return [{"output_ids": [4, 2], "meta_info": {"finish_reason": {"type": "stop"},
                                                         "output_token_logprobs": [(-0.5, 4, None), (-0.25, 2, None)]}}
                    for _ in input_ids]

    eng = object.__new__(SGLangEngine)
    eng.engine, eng.weight_version = _Sgl(), 0
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("RLHF_FAULT", "rollout_request_error@2")
    monkeypatch.delenv("RANK", raising=False)
    out = eng.generate([[1, 3], [1, 5], [1, 6]], SamplingConfig(n=1, temperature=0.0, max_new_tokens=4))
    assert [s.finish_reason for s in out] == ["stop", "abort", "stop"]
    assert out[1].response_ids == [] and failed_samples(out) == [1]
    assert out[0].response_ids == [4, 2] and out[0].response_log_probs == [-0.5, -0.25]
