"""Fully async training with multi-turn rollouts (rlhf.trainer.fully_async runs the agent loop rlhf.agent.loop) over a
scripted, versioned engine double (tests/support/agent_fakes.py): with partial_rollout a weight sync that comes while
a 3-turn trajectory is in flight pauses it at its next engine call and its later turns are generated on the new
weights (each model token keeps the engine's log-prob and version, tool tokens response_mask 0); without it the
trajectory finishes before the sync (drained); verl's staleness / partial metrics count it; the config composes."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rlhf.agent.config import MultiTurnSettings
from rlhf.agent.loop import AgentLoop
from rlhf.agent.tools import Gsm8kTool
from rlhf.config import compose_config
from rlhf.rollout.sampling import SamplingConfig
from rlhf.trainer.fully_async import FullyAsync
from tests.support.agent_fakes import GSM8K_SCHEMA, VersionedFleet, tool_call

MAX_LEN = 400
def three_turns(turn, prompt):
    calls = [tool_call("calc_gsm8k_reward", '{"answer": "%s"}' % a) for a in "45"]
    return ["Let me try. " + calls[0], "Again. " + calls[1], "The answer is 5. #### 5"][turn]


class Loader:
    """Batches of one row; row k asks "What is k + (5 - k)?"."""

    def __init__(self):
        self.drawn = 0

    def state_dict(self):
        return {"drawn": self.drawn}

    def next_batch(self):
        k = self.drawn
        self.drawn += 1
        return {"input_ids_list": [[k + 1]], "index": [k], "data_source": ["d"], "ground_truth": ["5"],
                "raw_prompt": [[{"role": "user", "content": f"What is {k} + {5 - k}?"}]],
                "extra_info": [{"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}}]}


class Rollout:
    """The RolloutWorker double: the versioned fleet, the agent loop, a weight sync that bumps the version."""
    rank0, host_group = True, None

    def __init__(self, tok, before):
        self.manager = VersionedFleet(tok, three_turns, before)
        self.agent = AgentLoop(MultiTurnSettings(enable=True), tok, MAX_LEN,
                               tools={"calc_gsm8k_reward": Gsm8kTool({}, GSM8K_SCHEMA)})
        self.train_sampling = SamplingConfig(n=1, max_new_tokens=MAX_LEN, seed=0)
        self.syncs = []  # (new version, fleet calls made before it)

    def ensure_resident(self):
        pass

    def sync_weights(self):
        self.manager.version += 1
        self.syncs.append((self.manager.version, len(self.manager.calls)))
        return SimpleNamespace(metrics=lambda: {"weight_sync/bytes": 1.0})


def _run(tok, partial: bool, chunk: int | None = None):
    """Two steps of B = 1 prompt, rollout.n = 1, a sync after each update, staleness 1: prompt 1's trajectory is
    generating when the trainer syncs after step 1 (its first turn's engine call is held until the sync is wanted).
    Returns (rollout double, [(metrics, samples)] of the two steps)."""
    over = ["async_training.enable=true", "rollout.multi_turn.enable=true", f"data.max_response_length={MAX_LEN}",
            "rollout.n=1", "actor.ppo_mini_batch_size=1", "async_training.staleness_threshold=1",
            "async_training.trigger_parameter_sync_step=1", f"async_training.partial_rollout={str(partial).lower()}"]
    if chunk is not None:
        over.append(f"async_training.partial_rollout_chunk_tokens={chunk}")
    cfg = compose_config(over)
    ref, second_started = [None], threading.Event()

    def before(prompt, turn):
        if turn == 0 and "What is 1 + 4?" in tok.decode(prompt) and not second_started.is_set():
            # prompt 1's first engine call: held until the trainer wants the sync
            second_started.set()
            p = ref[0]
            with p.cond:
                assert p.cond.wait_for(lambda: p.pause_wanted or p.stop, timeout=20)

    rollout = Rollout(tok, before)

    def finish(step, batch, started):
        samples = started.result()
        return samples, [1.0] * len(samples), [1.0] * len(samples), {}

    p = FullyAsync(cfg, rollout, Loader(), finish, lambda k: 1000 + k, total_steps=2)
    ref[0] = p
    out = []
    try:
        samples, _, _, m = p.next_round(1)
        out.append((m, samples))
        assert second_started.wait(20)  # prompt 1 is in flight: the sync comes during its first turn
        p.actor_updated(m)
        samples, _, _, m = p.next_round(2)
        out.append((m, samples))
    finally:
        p.close()
    return rollout, out


def _model_and_tool_spans(s):
    spans = s.extra["model_spans"]
    return spans, [(spans[k][1], spans[k + 1][0]) for k in range(len(spans) - 1)]


@pytest.mark.parametrize("chunk", [None, 5])
def test_a_trajectorys_later_turns_continue_on_the_new_weights(tok, chunk):
    rollout, [(m1, [s1]), (m2, [s2])] = _run(tok, partial=True, chunk=chunk)
    assert rollout.syncs[0][0] == 1
    # prompt 0: all its turns at version 0
    assert set(s1.extra["token_weight_versions"]) == {0} and m1["fully_async/partial/total_partial_num"] == 0
    # prompt 1: turn 1 at version 0, the sync, turns 2 and 3 at version 1
    versions, mask, lps = s2.extra["token_weight_versions"], s2.extra["response_mask"], s2.response_log_probs
    assert len(versions) == len(mask) == len(lps) == len(s2.response_ids)
    (a0, b0), (a1, b1), (a2, b2) = spans = s2.extra["model_spans"][:3]
    assert len(s2.extra["model_spans"]) == 3 and s2.finish_reason == "stop" and s2.extra["num_turns"] == 6
    # turn 1 and its tool reply on version 0 (with chunks of 5: turn 1's first chunk), the rest on version 1
    cut = a1 if chunk is None else a0 + chunk
    assert versions == [0] * cut + [1] * (len(versions) - cut)
    for a, b in spans:  # each model token: the double's log-prob at the version that sampled it
        assert mask[a:b] == [1] * (b - a)
        assert lps[a:b] == pytest.approx([-(versions[a + t] + t / 100) for t in range(b - a)])
    for a, b in _model_and_tool_spans(s2)[1]:  # tool tokens: mask 0, log-prob 0
        assert b > a and mask[a:b] == [0] * (b - a) and lps[a:b] == [0.0] * (b - a)
    # the engine calls: prompt 1's first turn before the sync, the others after it
    first_after = rollout.syncs[0][1]
    assert [(t, v) for t, _, v in rollout.manager.calls[first_after:]] == \
        [(t, 1) for t, _, _ in rollout.manager.calls[first_after:]] and \
        {t for t, _, _ in rollout.manager.calls[first_after:]} == ({1, 2} if chunk is None else {0, 1, 2})
    if chunk:  # turns generated in chunks of 5 tokens
        assert max(len(ids) for _, ids, _ in rollout.manager.calls) == 5
    # verl's partial metrics count the trajectory whose turns span the sync; staleness: its first token's version
    assert (m2["fully_async/partial/total_partial_num"], m2["fully_async/partial/max_partial_span"]) == (1.0, 1.0)
    assert m2["fully_async/partial/partial_ratio"] == 1.0
    assert (m2["async/staleness/max"], m2["async/weight_version"], s2.extra["weight_version"]) == (1.0, 1.0, 0)
    assert m2["fully_async/count/stale_samples_processed"] == 1.0


def test_without_partial_rollout_the_trajectory_in_flight_finishes_before_the_sync(tok):
    rollout, [(m1, [s1]), (m2, [s2])] = _run(tok, partial=False)
    assert set(s2.extra["token_weight_versions"]) == {0}  # drained: all three turns on the old weights
    assert len(s2.extra["model_spans"]) == 3 and s2.finish_reason == "stop"
    assert rollout.syncs == [(1, 6)]  # the sync came after both prompts' 3 turns
    assert m2["fully_async/partial/total_partial_num"] == 0.0 and m2["async/staleness/max"] == 1.0
    mask = s2.extra["response_mask"]
    for a, b in _model_and_tool_spans(s2)[1]:
        assert mask[a:b] == [0] * (b - a)


def test_fully_async_with_multi_turn_composes_at_cfg():
    from rlhf.config.errors import ConfigValidationError
    from rlhf.config.validate import validate_config

    validate_config(compose_config(["async_training.enable=true", "rollout.multi_turn.enable=true"]))
    with pytest.raises(ConfigValidationError, match=r"one_step_off_policy\.enable=true does not combine with "
                                                    r"rollout\.multi_turn\.enable=true"):
        validate_config(compose_config(["trainer.one_step_off_policy.enable=true", "rollout.multi_turn.enable=true"]))


def test_an_engine_crash_mid_trajectory_is_resynced_and_the_trajectory_goes_on(tok):
    """The only engine dies under the trajectory's second turn (StaleEnginesError, nothing finished): the rollouter
    waits at that turn, the trainer's main thread re-syncs the replaced engine, then the turn is generated again
    and the trajectory finishes -- no token from the replacement's checkpoint weights (version -1)."""
    from rlhf.rollout import StaleEnginesError

    cfg = compose_config(["async_training.enable=true", "rollout.multi_turn.enable=true",
                          f"data.max_response_length={MAX_LEN}", "rollout.n=1", "actor.ppo_mini_batch_size=1",
                          "async_training.trigger_parameter_sync_step=1", "async_training.partial_rollout=false"])
    events = []

    def before(prompt, turn):
        if turn == 1 and "crash" not in events:
            events.append("crash")
            rollout.manager.version, rollout.stale = -1, [0]  # the replacement serves its checkpoint
            raise StaleEnginesError([0], [], [0])
        assert not rollout.stale, "a replaced engine generated before its re-sync"

    rollout = Rollout(tok, before)
    rollout.stale = []

    def resync_replaced():
        stale, rollout.stale = rollout.stale, []
        if stale:
            rollout.manager.version = 0
            events.append("resync")
        return stale

    rollout.resync_replaced = resync_replaced

    def finish(step, batch, started):
        samples = started.result()
        return samples, [1.0] * len(samples), [1.0] * len(samples), {}

    p = FullyAsync(cfg, rollout, Loader(), finish, lambda k: 1000 + k, total_steps=1)
    try:
        [s], m = (lambda r: (r[0], r[3]))(p.next_round(1))
    finally:
        p.close()
    assert events == ["crash", "resync"] and m["fully_async/count/engine_resyncs"] == 1.0
    assert s.finish_reason == "stop" and len(s.extra["model_spans"]) == 3
    versions, lps = s.extra["token_weight_versions"], s.response_log_probs
    assert set(versions) == {0}
    for a, b in s.extra["model_spans"]:
        assert lps[a:b] == pytest.approx([-(versions[a + t] + t / 100) for t in range(b - a)])
