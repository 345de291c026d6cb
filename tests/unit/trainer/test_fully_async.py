"""Fully async training (rlhf.trainer.fully_async) over an engine double: verl's freshness budget, the bounded queue,
staleness per sample, partial rollout (a sync between chunks: the request continues on the new weights, every token
keeps its log-prob and weight version), a checkpoint taken mid-stream and resumed (no prompt trained twice or lost);
and the config: verl's fully_async_ppo_megatron_trainer.yaml composes, combinations that cannot work are refused."""
import textwrap
from types import SimpleNamespace

import pytest

from rlhf.config import compose_config
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import RolloutSample
from rlhf.trainer.fully_async import FullyAsync, admission_cap

MAX_LEN = 8


class Loader:
    """Prompt batches of `size` rows; row k's prompt is [k + 1] and its response length (to the stop token)
    1 + k % 8."""

    def __init__(self, drawn=0, size=2):
        self.drawn, self.size = drawn, size

    def state_dict(self):
        return {"drawn": self.drawn}

    def next_batch(self):
        rows = list(range(self.drawn, self.drawn + self.size))
        self.drawn += self.size
        n = self.size
        return {"input_ids_list": [[k + 1] for k in rows], "index": rows, "data_source": ["d"] * n,
                "ground_truth": ["g"] * n, "extra_info": [{}] * n, "raw_prompt": [None] * n}


class Engines:
    """The fleet double: each request continues its response (token t of prompt [k + 1] is 100 + t) until length
    1 + k % 8, log-prob -(version + t / 100); records the largest number of groups in the system."""

    def __init__(self, pipeline_ref):
        self.version, self.calls, self.ref, self.max_in_system = 0, [], pipeline_ref, 0
        self.wait_for_sync = True  # (trigger_parameter_sync_step=1: a sync follows every batch taken)

    def generate(self, prompts, sampling):
        p = self.ref[0]
        with p.cond:  # a slow engine: with a batch ready, this chunk ends once the trainer took it and wants a sync
            self.max_in_system = max(self.max_in_system, len(p.active) + len(p.finished))
            if self.wait_for_sync and len(p.finished) >= p.B:
                p.cond.wait_for(lambda: (len(p.finished) < p.B and p.pause_wanted) or p.stop, timeout=2.0)
        self.calls.append((len(prompts), sampling.max_new_tokens, sampling.n, self.version))
        out = []
        for i, ids in enumerate(prompts):
            k, done = ids[0] - 1, len(ids) - 1
            want = 1 + k % MAX_LEN
            new = list(range(100 + done, 100 + min(want, done + sampling.max_new_tokens)))
            out.append(RolloutSample(list(ids), new, [-(self.version + (done + t) / 100) for t in range(len(new))],
                                     "stop" if done + len(new) == want else "length", i, 0, self.version))
        return out


class Rollout:
    rank0, host_group = True, None

    def __init__(self, ref):
        self.manager = Engines(ref)
        self.train_sampling = SamplingConfig(n=2, max_new_tokens=MAX_LEN, seed=0)
        self.syncs = []

    def ensure_resident(self):
        pass

    def sync_weights(self):
        self.manager.version += 1
        self.syncs.append(self.manager.version)
        return SimpleNamespace(metrics=lambda: {"weight_sync/bytes": 1.0})


def _pipeline(overrides, total=6, loader=None):
    cfg = compose_config(["async_training.enable=true", f"data.max_response_length={MAX_LEN}", "rollout.n=2",
                          "actor.ppo_mini_batch_size=2", *overrides])
    ref = [None]
    rollout, loader = Rollout(ref), loader or Loader()

    def finish(step, batch, started):
        samples = started.result()
        return samples, [1.0] * len(samples), [1.0] * len(samples), {}

    p = FullyAsync(cfg, rollout, loader, finish, lambda k: 1000 + k, total)
    ref[0] = p
    return p, rollout


def _train(p, steps, first=1):
    """The trainer's part: take a batch, update the actor (syncs when due); returns [(prompt indices, metrics,
    samples)]."""
    out = []
    for step in range(first, first + steps):
        samples, _, _, m = p.next_round(step)
        p.actor_updated(m)
        out.append((step, m, samples))
    return out


def _indices(p_samples):
    return [s.prompt_ids[0] - 1 for s in p_samples if s.sample_index == 0]


def test_admission_cap_is_verls_freshness_bound():
    cfg = SimpleNamespace(staleness_threshold=0.5, trigger_parameter_sync_step=2, require_batches=1)
    assert admission_cap(cfg, 4, 3) == 9  # floor(1.5 x 2 x 1 x 4) - 3
    cfg.staleness_threshold = 0.0
    assert admission_cap(cfg, 4, 0) == 8


def test_staleness_zero_is_on_policy_and_streams_every_prompt_once():
    p, rollout = _pipeline(["async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
                            "async_training.partial_rollout=false"])
    try:
        steps = _train(p, 5)
    finally:
        p.close()
    for _, m, samples in steps:
        assert m["async/staleness/max"] == 0.0 and m["fully_async/partial/total_partial_num"] == 0.0
        assert all(len(s.response_ids) == len(s.response_log_probs) == len(s.extra["token_weight_versions"])
                   for s in samples)
    trained = [k for _, _, s in steps for k in _indices(s)]
    assert sorted(trained) == list(range(10))  # 5 steps x B = 2 prompts: each drawn prompt once
    assert rollout.syncs == [1, 2, 3, 4, 5]
    assert rollout.manager.max_in_system <= 2  # (1 + 0) x 1 x 1 x 2 groups between syncs
    assert {c[1] for c in rollout.manager.calls} <= set(range(1, MAX_LEN + 1)) and {c[2] for c in
                                                                                    rollout.manager.calls} == {1}


def test_partial_rollout_continues_on_the_new_weights_keeping_each_tokens_log_prob_and_version():
    p, rollout = _pipeline(["async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1",
                            "async_training.partial_rollout_chunk_tokens=2"], total=8)
    try:
        steps = _train(p, 8)
    finally:
        p.close()
    spans, stale = 0, 0
    for step, (_, m, samples) in enumerate(steps, start=1):
        for s in samples:
            k = s.prompt_ids[0] - 1
            versions = s.extra["token_weight_versions"]
            assert s.response_ids == list(range(100, 101 + k % MAX_LEN)) and s.finish_reason == "stop"
            assert versions == sorted(versions) and versions[0] == s.extra["weight_version"]
            # each token's log-prob is the engine's at the version that sampled it
            assert s.response_log_probs == pytest.approx([-(v + t / 100) for t, v in enumerate(versions)])
            spans += versions[-1] > versions[0]
            stale = max(stale, (step - 1) - versions[0])
        assert m["fully_async/partial/total_partial_num"] == sum(
            s.extra["token_weight_versions"][-1] > s.extra["weight_version"] for s in samples)
        assert m["async/staleness/max"] == max((step - 1) - s.extra["weight_version"] for s in samples)
    assert spans > 0  # some responses span a weight sync (partial rollout)
    assert stale >= 1  # and samples were trained one or more updates old
    assert rollout.manager.max_in_system <= 4  # (1 + 1) x 1 x 1 x 2
    assert sorted(k for _, _, s in steps for k in _indices(s)) == list(range(16))


def test_checkpoint_mid_stream_then_resume_trains_every_prompt_exactly_once():
    over = ["async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=2",
            "async_training.partial_rollout_chunk_tokens=3"]
    p, rollout = _pipeline(over, total=8)
    rollout.manager.wait_for_sync = False
    try:
        first = _train(p, 3)
        loader_state, state = p.checkpoint_state()  # the checkpoint after step 3
        more = _train(p, 1, first=4)  # step 4 trained, then "killed": lost with the process
    finally:
        p.close()
    assert state["pending"]  # prompts drawn and not trained were in flight / queued at the checkpoint
    assert more
    q, rollout = _pipeline(over, total=8, loader=Loader(drawn=loader_state["drawn"]))
    rollout.manager.wait_for_sync = False
    q.load_state_dict(state)
    try:
        rest = _train(q, 5, first=4)
    finally:
        q.close()
    trained = [k for _, _, s in first + rest for k in _indices(s)]
    assert sorted(trained) == list(range(16))  # 8 steps x 2 prompts: none twice, none lost
    assert _indices(rest[0][2])[:1][0] in [r["index"] for r in state["pending"]]


def test_verls_fully_async_megatron_config_composes(tmp_path):
    """verl's verl/experimental/fully_async_policy/config/fully_async_ppo_megatron_trainer.yaml (all its settings),
    read by name with the pool keys of its shell scripts: the mode on, verl's values, the rest accepted."""
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "fully_async_ppo_megatron_trainer.yaml").write_text(textwrap.dedent("""
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_megatron_trainer
          - _self_
        async_training:
          staleness_threshold: 0.1
          trigger_parameter_sync_step: 4
          require_batches: 1
          partial_rollout: True
          use_rollout_log_probs: True
          compute_prox_log_prob: False
          use_trainer_do_validate: False
          checkpoint_engine:
            enable: True
            device_buffer_size_M: 4096
            overlap_broadcast_and_consume: False
        rollout:
          nnodes: 1
          n_gpus_per_node: 8
          n: 4
          total_rollout_steps: 100
          total_epochs: 10
          test_freq: 1
        data:
          gen_batch_size: 1
        actor_rollout_ref:
          checkpoint_engine: ${oc.select:async_training.checkpoint_engine, null}
          actor:
            use_rollout_log_probs: ${oc.select:async_training.use_rollout_log_probs, True}
    """))
    cfg = compose_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.hybrid_engine=False",
                          "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
                          "async_training.staleness_threshold=0.5", "async_training.partial_rollout=False"],
                         config_file=conf / "fully_async_ppo_megatron_trainer.yaml")
    a = cfg.async_training
    assert a.enable is True and (a.staleness_threshold, a.trigger_parameter_sync_step, a.require_batches) == (0.5, 4, 1)
    assert (a.partial_rollout, a.use_rollout_log_probs, a.compute_prox_log_prob) == (False, True, False)
    assert (cfg.rollout.mode, cfg.rollout.num_engines, cfg.rollout.n) == ("disaggregated", 4, 4)
    assert not compose_config([]).async_training.enable


@pytest.mark.parametrize("extra,expected", [
    (["trainer.one_step_off_policy.enable=true"], "does not combine with trainer.one_step_off_policy.enable=true"),
    (["algorithm=dapo"], "does not combine with algorithm.filter_groups.enable=true"),
    (["algorithm.adv_estimator=remax"], "does not combine with algorithm.adv_estimator=remax"),
    (["algorithm.rollout_correction.rollout_is=token"],
     "rollout_is=token with async_training.use_rollout_log_probs=true and compute_prox_log_prob=false"),
    (["async_training.staleness_threshold=-1"], "async_training.staleness_threshold"),
    (["async_training.require_batches=0"], "async_training.require_batches"),
])
def test_combinations_that_cannot_work_are_refused_at_cfg(extra, expected):
    from rlhf.config.errors import ConfigValidationError
    from rlhf.config.validate import validate_config

    with pytest.raises(ConfigValidationError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        validate_config(compose_config(["async_training.enable=true", *extra]))
    validate_config(compose_config(["async_training.enable=true", "algorithm.rollout_correction.rollout_is=token",
                                    "async_training.compute_prox_log_prob=true"]))


def test_validation_pauses_the_rollouter_and_syncs_the_current_actor():
    p, rollout = _pipeline(["async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=4"])
    rollout.manager.wait_for_sync = False
    try:
        _train(p, 1)
        assert rollout.syncs == []  # 1 update of 4 before a sync
        p.quiesce()
        assert rollout.syncs == [1] and p.paused and p.engine_version == 1
        calls = len(rollout.manager.calls)
        samples, _, _, m = p.next_round(2)  # resumes the rollouter
        assert p.thread.is_alive() and m["fully_async/count/current_param_version"] == 1.0
        p.quiesce()
        assert rollout.syncs == [1] and len(rollout.manager.calls) >= calls  # nothing changed: no sync
    finally:
        p.close()


@pytest.mark.parametrize("name", ["fully_async_ppo_megatron_trainer", "fully_async_ppo_trainer"])
def test_verls_own_fully_async_config_files_compose(name, tmp_path):
    """The files themselves, from a fetched copy of verl (skipped without one): read by name, they turn the mode on
    with verl's values."""
    import subprocess
    from pathlib import Path

    mirror = Path("/work/.mirror/volcengine+verl/repo")
    if not mirror.exists():
        pytest.skip(f"no fetched copy of verl at {mirror}")
    r = subprocess.run(["git", "--git-dir", str(mirror), "show",
                        f"HEAD:verl/experimental/fully_async_policy/config/{name}.yaml"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{name}.yaml is not in {mirror}")
    (tmp_path / f"{name}.yaml").write_text(r.stdout)
    cfg = compose_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.hybrid_engine=False",
                          "trainer.n_gpus_per_node=8", "trainer.nnodes=1"], config_file=tmp_path / f"{name}.yaml")
    a = cfg.async_training
    assert a.enable and (a.staleness_threshold, a.trigger_parameter_sync_step, a.require_batches) == (0.1, 4, 1)
    assert a.partial_rollout and a.use_rollout_log_probs and not a.compute_prox_log_prob
    assert cfg.rollout.mode == "disaggregated"


def _finishes(p, step, timeout=20.0):
    """next_round(step) in a thread: whether it returned within `timeout` s (a rollouter that cannot admit hangs)."""
    import threading

    done = []
    t = threading.Thread(target=lambda: done.append(p.next_round(step)), daemon=True)
    t.start()
    t.join(timeout)
    return bool(done)


def test_rows_drawn_but_not_admitted_do_not_use_up_the_admission_budget():
    """Loader batches larger than a step's prompts (data.train_batch_size 6, B = 2) at staleness 0: the 4 rows drawn
    and waiting are not carried over a sync (they were never admitted), else the budget went negative and the
    rollouter stopped for good (the trainer waited forever)."""
    p, rollout = _pipeline(["async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1"],
                           total=6, loader=Loader(size=6))
    rollout.manager.wait_for_sync = False
    try:
        for step in range(1, 4):
            assert _finishes(p, step), step
            p.actor_updated({})
    finally:
        p.close()


def test_a_resume_with_a_full_window_of_pending_rows_admits_them():
    """The checkpoint held as many pending rows as a window admits ((1 + 1) x 1 x 2 = 4): the resumed rollouter
    generates them again (they are not carried in flight), it does not wait for budget that never comes."""
    p, rollout = _pipeline(["async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1"],
                           total=8, loader=Loader(drawn=10))
    rollout.manager.wait_for_sync = False
    rows = Loader(drawn=6, size=4).next_batch()
    p.load_state_dict({"actor_version": 3, "consumed": 6,
                       "pending": [{k: rows[k][i] for k in rows} for i in range(4)]})
    try:
        assert _finishes(p, 4)
        assert _finishes(p, 5)
    finally:
        p.close()


class CrashingEngines(Engines):
    """The one-engine fleet dies under generate call ``crash_at`` after the first half of its prompts finished, as
    RolloutManager reports it (StaleEnginesError: the samples done, the prompts left); the replacement serves the
    checkpoint it started from (version -1) and, like the manager, is never used while stale.  ``events``: what
    happened in order."""

    def __init__(self, ref, crash_at):
        super().__init__(ref)
        self.crash_at, self.stale, self.events, self.served, self.crashed = crash_at, set(), [], 0, False
        self.wait_for_sync = False

    def stale_engines(self):
        return sorted(self.stale)

    def generate(self, prompts, sampling):
        from rlhf.rollout import StaleEnginesError

        if self.stale:  # the manager never generates on a stale engine
            self.events.append("refused")
            raise StaleEnginesError(sorted(self.stale), [], list(range(len(prompts))))
        out = super().generate(prompts, sampling)
        self.served += 1
        self.events.append(("generate", self.version))
        if not self.crashed and self.crash_at(self.served, self.ref[0]):
            half, self.crashed = len(out) // 2, True
            self.synced_version, self.version, self.stale = self.version, -1, {0}
            self.events.append("crash")
            raise StaleEnginesError([0], out[:half], list(range(half, len(prompts))))
        return out


class ResyncRollout(Rollout):
    """The RolloutWorker double whose syncs also re-sync replaced engines (sync_weights' stale loop)."""

    def __init__(self, ref, crash_at):
        super().__init__(ref)
        self.manager = CrashingEngines(ref, crash_at)

    def sync_weights(self):
        self.manager.version = self.manager.ref[0].actor_version  # the engines now serve the actor's version
        self.syncs.append(self.manager.version)
        self.manager.stale.clear()
        self.manager.events.append(("sync", self.manager.version))
        return SimpleNamespace(metrics=lambda: {"weight_sync/bytes": 1.0})

    def resync_replaced(self):
        stale = self.manager.stale_engines()
        if stale:  # the actor's weights are the engines' version (the fully async pipeline only asks then)
            self.manager.version, self.manager.stale = self.manager.synced_version, set()
            self.manager.events.append(("resync", self.manager.version))
        return stale


def _ahead(p):
    """Wait (a slow engine) until the trainer updated the actor past the engines' version (step 1 trained)."""
    with p.cond:
        return p.cond.wait_for(lambda: p.actor_version != p.engine_version, timeout=20.0)


@pytest.mark.parametrize("trigger,crash_at", [
    (1, lambda calls, p: calls == 3),  # the actor is the engines' version: the replaced engine alone is synced
    (2, lambda calls, p: calls == 3 and _ahead(p)),  # the actor moved on: a weight sync of every engine
])
def test_an_engine_crash_mid_stream_is_resynced_and_the_run_goes_on(trigger, crash_at, caplog):
    """The only engine dies mid-stream (its generate call half done): the rollouter keeps the finished samples,
    hands the replaced engine to the trainer, which syncs it at a safe point (its main thread, a collective) before
    it serves again; the run goes on, every prompt trained once, each token's log-prob the engine's at the version
    recorded for it (no token from the replacement's checkpoint weights)."""
    cfg = compose_config(["async_training.enable=true", f"data.max_response_length={MAX_LEN}", "rollout.n=2",
                          "actor.ppo_mini_batch_size=2", "async_training.staleness_threshold=1",
                          f"async_training.trigger_parameter_sync_step={trigger}",
                          "async_training.partial_rollout_chunk_tokens=2"])
    ref = [None]
    rollout = ResyncRollout(ref, crash_at)

    def finish(step, batch, started):
        samples = started.result()
        return samples, [1.0] * len(samples), [1.0] * len(samples), {}

    p = FullyAsync(cfg, rollout, Loader(), finish, lambda k: 1000 + k, 6)
    ref[0] = p
    try:
        with caplog.at_level("WARNING", logger="rlhf.trainer.fully_async"):
            steps = _train(p, 6)
    finally:
        p.close()
    events = rollout.manager.events
    assert "crash" in events
    after = [e for e in events[events.index("crash") + 1:] if e != "refused"]
    assert after[0] == ("resync" if trigger == 1 else "sync", events[events.index("crash") - 1][1] + trigger - 1)
    assert all(e[1] >= 0 for e in events if isinstance(e, tuple) and e[0] == "generate")
    for _, m, samples in steps:
        for s in samples:
            k, versions = s.prompt_ids[0] - 1, s.extra["token_weight_versions"]
            assert s.response_ids == list(range(100, 101 + k % MAX_LEN)) and s.finish_reason == "stop"
            assert s.response_log_probs == pytest.approx([-(v + t / 100) for t, v in enumerate(versions)])
    assert sorted(k for _, _, s in steps for k in _indices(s)) == list(range(12))  # none lost, none twice
    assert steps[-1][1]["fully_async/count/engine_resyncs"] == 1.0
    assert sum("replaced" in r.getMessage() for r in caplog.records) == 1  # logged once
