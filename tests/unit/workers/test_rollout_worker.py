"""The trainer's RolloutWorker drives the colocated engine lifecycle in GPU order on every device:
generate (engines resident) -> release -> train -> resume weights -> sync -> resume KV cache, so validation right
after a step generates on resident engines and weights are never synced into released memory.  One process
(world size 1), the engines and the weight bridge replaced by stand-ins (tests/support/fakes.py)."""
import os
import socket

import pytest
import torch.distributed as dist

import rlhf.workers.rollout as rollout_mod
from rlhf.config import compose_config
from tests.support.fakes import FakeRolloutManager, RecordingBridge


@pytest.fixture
def world1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def worker(world1, tmp_path, monkeypatch):
    return make_worker(tmp_path, monkeypatch)


def make_worker(tmp_path, monkeypatch, extra=()):
    from tests.support.tiny_models import make_tiny_hf_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    make_tiny_hf_model(str(tmp_path), "llama_gqa", vocab_size=len(tok), num_layers=1, tokenizer=tok)
    manager = FakeRolloutManager()
    monkeypatch.setattr(rollout_mod, "start_rollout", lambda cfg, path: manager)
    import rlhf.weight_bridge as ws

    monkeypatch.setattr(ws, "WeightBridge", lambda chunks, spec, engines, config: RecordingBridge(engines))
    cfg = compose_config(["rollout.n=2", "rollout.mode=colocated", "rollout.weight_sync_bucket_mb=1",
                          "rollout.weight_sync_check=false", "rollout.max_restarts=1", "data.max_response_length=4",
                          *extra])
    bundle = type("Bundle", (), {"chunks": [], "spec": None})()
    return rollout_mod.RolloutWorker(cfg, str(tmp_path), bundle, tok), manager


class Reward:
    def score(self, texts, sources, truths, extra_infos=None, prompts=None):
        return [1.0] * len(texts), {"reward/num_fallbacks": 0.0}


def batch(n):
    return {"input_ids_list": [[1, 2, 3]] * n, "data_source": ["x"] * n, "ground_truth": ["1"] * n,
            "extra_info": [{}] * n, "raw_prompt": ["p"] * n}


def test_step_then_validation_generates_on_resident_engines(worker):
    w, manager = worker
    # step 1: nothing was released before the first generation (a resume there must not reach SGLang)
    with w.serving():
        samples, scores, metrics = w.generate(batch(2), w.train_sampling, Reward())
    assert len(samples) == 4 and scores == [1.0] * 4 and metrics["rollout/num_restarts"] == 0.0
    assert manager.released == {"kv_cache", "weights"}  # the trainer has the devices while it trains
    w.sync_weights()
    assert manager.released == set()
    # validation right after the step: resident engines (the old order released them after the sync)
    _, val_scores, _ = w.generate(batch(3), w.val_sampling, Reward())
    assert len(val_scores) == 3
    assert manager.log == ["resume:kv_cache,weights", "generate", "release", "resume:weights", "sync",
                           "resume:kv_cache", "generate"]


def test_resume_from_checkpoint_syncs_into_resident_engines(worker):
    w, manager = worker
    w.sync_weights()  # BaseTrainer's resume syncs before any generation
    assert manager.log == ["resume:weights", "sync", "resume:kv_cache"] and manager.released == set()


class UnscorableReward:
    """A reward outage: every sample unscorable (the trainer skips the actor and critic updates)."""

    def score(self, texts, sources, truths, extra_infos=None, prompts=None):
        from rlhf.rewards.validity import SAMPLE_VALID_KEY

        return [0.0] * len(texts), {"reward/num_fallbacks": 0.0, SAMPLE_VALID_KEY: [False] * len(texts)}


def ppo_trainer(worker, reward):
    """PPOTrainer.train_step over the real RolloutWorker (fake engines and bridge) and stand-in actor / critic."""
    from rlhf.trainer.perf import PerfMeter
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from tests.support.fakes import FakeActor, FakePromptLoader

    w, _ = worker
    trainer = object.__new__(PPOTrainer)
    trainer.cfg = compose_config(["rollout.n=2", "rollout.mode=colocated", "data.max_response_length=4",
                                  "trainer.critic_warmup=1"])
    trainer.tokenizer, trainer.reward, trainer.rollout = w.tokenizer, reward, w
    trainer.train_loader = FakePromptLoader([batch(2) for _ in range(3)])
    trainer.actor, trainer.critic, trainer.reference = FakeActor(), FakeActor(), None
    trainer.kl_ctrl, trainer.policy_loss = None, "loss"
    trainer.perf = PerfMeter({}, "cpu", 1, {})
    return trainer


def test_critic_warmup_step_then_validation_and_next_step_serve_synced_weights(worker):
    """A critic warm-up step does not change the actor and syncs nothing, but serving() released the colocated
    engines' weights, which SGLang's memory saver discards: the validation right after it (PPOTrainer.validate
    starts with ensure_resident) and the next step's serving() must sync first (the fake manager refuses
    resumed-but-unsynced weights as rlhf.rollout.manager.RolloutManager does)."""
    w, manager = worker
    trainer = ppo_trainer(worker, Reward())
    m = trainer.train_step(1)  # warm-up: only the critic trains, nothing is synced
    assert trainer.actor.updates == [] and trainer.critic.updates == [1]
    assert "timing_s/update_weights" not in m and w.weights_released
    w.ensure_resident()  # what validate() does first
    _, val_scores, _ = w.generate(batch(3), w.val_sampling, Reward())  # validation after the warm-up step
    assert len(val_scores) == 3 and not manager.weights_discarded
    trainer.train_step(2)  # the actor trains and is synced as before
    assert trainer.actor.updates == [2]
    sync = ["resume:weights", "sync", "resume:kv_cache"]
    assert manager.log == (["resume:kv_cache,weights", "generate", "release"] + sync + ["generate"] +
                           ["resume:kv_cache,weights", "generate", "release"] + sync)


def test_critic_warmup_step_then_next_step_syncs_before_generating(worker):
    """Two steps in a row without validation: the second step's serving() refills the weights step 1 released."""
    w, manager = worker
    trainer = ppo_trainer(worker, Reward())
    trainer.train_step(1)
    trainer.train_step(2)
    assert not manager.weights_discarded and trainer.actor.updates == [2]
    assert manager.log[3:7] == ["resume:weights", "sync", "resume:kv_cache", "generate"]


def test_step_with_no_scorable_sample_leaves_engines_serving(worker):
    """A batch without any scorable sample skips both updates; the next generation still serves synced weights."""
    w, manager = worker
    trainer = ppo_trainer(worker, UnscorableReward())
    m = trainer.train_step(2)  # past the warm-up: only the missing signal skips the actor update
    assert m["training/no_scorable_samples"] == 1.0 and trainer.actor.updates == trainer.critic.updates == []
    assert not manager.weights_discarded
    trainer.reward = Reward()
    trainer.train_step(3)
    assert trainer.actor.updates == [3] and manager.log.count("sync") == 2


def test_generation_on_resumed_unsynced_weights_is_refused(worker):
    """Resumed weights are memory, not weights: generate() refuses until a sync refills them."""
    from rlhf.rollout.manager import WeightsDiscardedError

    w, manager = worker
    with w.serving():
        w.generate(batch(1), w.train_sampling, Reward())
    w.resume()
    with pytest.raises(WeightsDiscardedError, match="sync"):
        w.generate(batch(1), w.val_sampling, Reward())
    w.ensure_resident()
    assert len(w.generate(batch(1), w.val_sampling, Reward())[1]) == 1


def test_critic_warmup_step_resyncs_before_the_next_generation(worker):
    """A critic-warm-up step updates no actor and syncs nothing, but the engines released their weights while
    the trainer computed: SGLang's memory saver resumes them as undefined memory.  The next generation (the
    next step's or a validation's) refills them first."""
    w, manager = worker
    with w.serving():  # step 1 (critic warm-up): generate, release, no actor update, no sync
        w.generate(batch(2), w.train_sampling, Reward())
    assert manager.released == {"kv_cache", "weights"} and w.weights_released
    with w.serving():  # step 2: weights back before generating
        w.generate(batch(2), w.train_sampling, Reward())
    assert manager.log == ["resume:kv_cache,weights", "generate", "release", "resume:weights", "sync",
                           "resume:kv_cache", "generate", "release"]


def test_validation_after_a_critic_warmup_step_generates_on_synced_engines(worker):
    """PPOTrainer.validate calls ensure_resident: after a warm-up step (engines released, no sync) validation
    generated on released engines and the run stopped at the first validation after it."""
    w, manager = worker
    with w.serving():
        w.generate(batch(2), w.train_sampling, Reward())
    w.ensure_resident()  # what validate() does first
    _, scores, _ = w.generate(batch(3), w.val_sampling, Reward())
    assert len(scores) == 3 and not w.weights_released
    assert manager.log[-4:] == ["resume:weights", "sync", "resume:kv_cache", "generate"]
    w.ensure_resident()  # resident and synced: no second sync (the manager's resume of nothing is a no-op)
    assert manager.log[-2:] == ["generate", "resume:kv_cache,weights"] and manager.released == set()



def test_every_weight_sync_runs_with_the_actor_parameters_resident(worker):
    """With the actor's parameters offloaded (actor.offload.params) the trainer gives the worker the actor's
    ``resident`` (rlhf.trainer.ppo_trainer): each sync -- after an update, and the one serving() needs after a
    critic warm-up step -- reads the parameters inside it, and generation runs without them."""
    import contextlib

    w, manager = worker

    @contextlib.contextmanager
    def resident():
        manager.log.append("actor params in")
        yield
        manager.log.append("actor params out")

    w.actor_resident = resident
    with w.serving():
        w.generate(batch(1), w.train_sampling, Reward())
    w.sync_weights()  # an actor update
    with w.serving():
        w.generate(batch(1), w.train_sampling, Reward())
    # a critic warm-up step: no update; serving() re-syncs the weights released since the last sync
    with w.serving():
        w.generate(batch(1), w.train_sampling, Reward())
    log = manager.log
    syncs = [k for k, e in enumerate(log) if e == "sync"]
    assert len(syncs) == 2 and all(log[k - 1] == "actor params in" and log[k + 1] == "actor params out" for k in syncs)
    assert log.count("actor params in") == 2 and log.count("generate") == 3


def test_other_ranks_wait_for_rank_0_on_the_host(world1, tmp_path, monkeypatch):
    """The ranks other than 0 wait for rank 0 while it starts the engines, generates and scores (minutes): every
    such wait (the object broadcasts and barriers of the worker) goes through a gloo group of the worker's own, never
    the default group, which is NCCL on a GPU run: there each rank would wait in an NCCL kernel spinning on its GPU,
    time-sliced against the colocated engine rank on that GPU for the whole generation."""
    calls = []
    for name in ("barrier", "broadcast_object_list"):
        original = getattr(dist, name)

        def record(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, kwargs.get("group")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, record)
    w, manager = make_worker(tmp_path, monkeypatch)
    with w.serving():
        w.generate(batch(2), w.train_sampling, Reward())
    w.sync_weights()
    assert [n for n, _ in calls].count("barrier") >= 5 and [n for n, _ in calls].count("broadcast_object_list") >= 3
    assert all(g is not None and g is not dist.group.WORLD and dist.get_backend(g) == "gloo" for _, g in calls), calls
    assert len({id(g) for _, g in calls}) == 1  # one group, made once


@pytest.mark.parametrize("finished", [True, False])
def test_engines_stop_after_every_rank_left_the_bridge(world1, tmp_path, monkeypatch, finished):
    """At a run's end every rank leaves the bridge (drops its mappings of the engines' memory, leaves the
    weight-update groups), then the ranks meet, and only then rank 0 stops the engines: a rank closing after the
    engines' shared-memory manager died aborted its exit.  After an error no rank waits (another may never come)."""
    w, manager = make_worker(tmp_path, monkeypatch)
    original = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (manager.log.append("barrier"), original(*a, **k))[1])
    w.close(finished)
    want = ["bridge close", "barrier", "shutdown"] if finished else ["bridge close", "shutdown"]
    assert manager.log[-len(want):] == want and manager.log.count("barrier") == int(finished), manager.log


class SlowReward(Reward):
    def score(self, texts, sources, truths, extra_infos=None, prompts=None):
        import time

        time.sleep(0.3)
        return super().score(texts, sources, truths, extra_infos, prompts)


def test_reward_is_timed_apart_from_the_generation(worker):
    """verl's timing_s/reward: the scoring's seconds, measured where rank 0 scores (RolloutWorker.generate), and
    timing_s/gen without them (before: no timing_s/reward, the reward inside timing_s/gen)."""
    w, _ = worker
    _, _, metrics = w.generate(batch(2), w.train_sampling, SlowReward())
    assert metrics["timing_s/reward"] >= 0.3
    m = ppo_trainer(worker, SlowReward()).train_step(1)
    assert m["timing_s/reward"] >= 0.3 and m["timing_s/gen"] < 0.3  # the fake engines answer at once


def test_checkpoint_save_runs_with_the_colocated_engines_released(worker, tmp_path, monkeypatch):
    """PPOTrainer.save_checkpoint (BaseTrainer's, inside PPOTrainer.save_context) writes the checkpoint while the
    colocated engines hold no weights or KV cache (megatron's distributed-optimizer save all-gathers over DP on the
    GPU: the memory plan's "checkpoint save" phase counts no engine memory), then brings them back with the actor's
    weights (a sync: SGLang's memory saver keeps no copy), so validation after the save generates."""
    import rlhf.trainer.base as base
    from rlhf.trainer.ppo_trainer import PPOTrainer

    w, manager = worker
    w.sync_weights()  # after a step: engines resident, synced
    manager.log.clear()
    at_write = []
    monkeypatch.setattr(base, "save_checkpoint_dir", lambda root, step, roles, state, keep, slim: at_write.append(
        set(manager.released)) or os.path.join(root, f"global_step_{step}"))
    monkeypatch.setattr(base, "model_summary", lambda hf_config: {})
    trainer = object.__new__(PPOTrainer)  # only what save_checkpoint reads
    trainer.cfg, trainer.hf_config, trainer.rollout = w.cfg, None, w
    trainer.actor = trainer.critic = trainer.reference = None
    monkeypatch.setattr(trainer, "trainer_state", lambda: {}, raising=False)
    monkeypatch.setattr(trainer, "checkpoint_roles", lambda: {}, raising=False)
    trainer.save_checkpoint(3)
    assert at_write == [{"kv_cache", "weights"}]
    # left released: the step's metrics come right after the save, and the next generation resumes and syncs
    # (resuming at once synced twice, and a kill in that sync lost the step's metrics: tests/e2e/test_fault_matrix)
    assert manager.log == ["release"] and manager.released == {"kv_cache", "weights"}
    with w.serving():  # as the next step's generation
        _, scores, _ = w.generate(batch(1), w.val_sampling, Reward())
    assert scores == [1.0] * 1
    assert manager.log[:4] == ["release", "resume:weights", "sync", "resume:kv_cache"]


def test_released_is_a_no_op_for_disaggregated_engines(world1, tmp_path, monkeypatch):
    w, manager = make_worker(tmp_path, monkeypatch)
    w.colocated = False  # disaggregated engines hold GPUs of their own
    with w.released():
        assert manager.released == set()
    assert manager.log == []


def test_fully_async_multi_turn_scores_the_rollouters_trajectories_as_they_are(world1, tmp_path, monkeypatch):
    """Fully async with multi-turn: the rollouter ran the agent loop (rlhf.trainer.fully_async); generate() with its
    finished trajectories (``started``) scores them without generating again, the tool fields in extra_info."""
    from concurrent.futures import Future

    from rlhf.rollout.types import RolloutSample

    w, manager = make_worker(tmp_path, monkeypatch, ["async_training.enable=true", "rollout.multi_turn.enable=true"])
    done = [RolloutSample([1, 2, 3], [5, 6, 7], [-0.1, 0.0, -0.2], "length" if i + j == 2 else "stop", i, j, 0,
                          extra={"response_mask": [1, 0, 1], "num_turns": 2 + i, "tool_rewards": [0.5] * (1 + i),
                                 "turn_scores": [], "token_weight_versions": [0, 0, 1]})
            for i in range(2) for j in range(2)]
    seen = []

    class Seen(Reward):
        def score(self, texts, sources, truths, extra_infos=None, prompts=None):
            seen.extend(extra_infos)
            return super().score(texts, sources, truths, extra_infos, prompts)

    started = Future()
    started.set_result(done)
    samples, scores, m = w.generate(batch(2), w.train_sampling, Seen(), started=started)
    assert samples == done and scores == [1.0] * 4 and "generate" not in manager.log
    assert [e["num_turns"] for e in seen] == [2, 2, 3, 3] and seen[0]["tool_rewards"] == [0.5]
    assert (m["num_turns/mean"], m["num_turns/max"], m["num_turns/min"]) == (2.5, 3.0, 2.0)
    assert (m["tool_calls/mean"], m["multi_turn/tool_reward/mean"]) == (1.5, 0.75)  # (1 + 1 + 2 + 2) / 4, x 0.5
    assert (m["multi_turn/truncated"], m["multi_turn/aborted"]) == (1.0, 0.0)
