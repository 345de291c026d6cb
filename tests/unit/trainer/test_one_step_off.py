"""One-step off-policy (rlhf.trainer.one_step_off) with a fake rollout worker: the order of generation, weight syncs
and training, the weight version and staleness of each batch, what a checkpoint saves; and the config: verl's
one_step_off_ppo_trainer file composes (and turns the mode on), bad settings are refused at --cfg."""
import textwrap
from types import SimpleNamespace

import pytest

from rlhf.config import compose_config
from rlhf.trainer.one_step_off import OneStepOff


class FakeLoader:
    def __init__(self):
        self.i = 0

    def state_dict(self):
        return {"epoch": 0, "step_in_epoch": self.i}

    def next_batch(self):
        self.i += 1
        return {"index": [10 * self.i, 10 * self.i + 1]}


class FakeRollout:
    """Records the calls in order; a 'generation' is the prompts plus the engines' weights at the start."""
    rank0 = True
    train_sampling = "sampling"

    def __init__(self):
        self.calls, self.engine_weights, self.actor_weights = [], 0, 0

    def ensure_resident(self):
        pass

    def generate_async(self, prompts, sampling, seed=None):
        self.calls.append(("start", prompts["index"][0], self.engine_weights, seed))
        return SimpleNamespace(prompts=prompts, weights=self.engine_weights,
                               exception=lambda: self.calls.append(("wait", prompts["index"][0])))

    def sync_weights(self):
        self.calls.append(("sync", self.actor_weights))
        self.engine_weights = self.actor_weights
        return SimpleNamespace(metrics=lambda: {"weight_sync/bytes": 1.0})


def _pipeline(staleness, total=4):
    cfg = compose_config([f"trainer.one_step_off_policy.enable=true",
                          f"trainer.one_step_off_policy.staleness={staleness}"])
    rollout, loader = FakeRollout(), FakeLoader()

    def finish(step, prompts, started):
        rollout.calls.append(("collect", prompts["index"][0], started.weights))
        samples = [SimpleNamespace(extra={}) for _ in range(2)]
        return samples, [1.0, 0.0], [1.0, 0.0], {"gen": step}

    return OneStepOff(cfg, rollout, loader, finish, lambda step: 100 + step, total), rollout, loader


def _train(p, rollout, step):
    samples, _, _, m = p.next_round(step)
    rollout.calls.append(("train", step))
    rollout.actor_weights += 1
    p.actor_updated()
    return samples, m


def test_staleness_one_overlaps_and_bounds_staleness():
    p, rollout, _ = _pipeline(1)
    metrics = [_train(p, rollout, step)[1] for step in range(1, 5)]
    assert rollout.calls == [
        ("start", 10, 0, 101), ("collect", 10, 0), ("start", 20, 0, 102), ("train", 1),
        ("collect", 20, 0), ("sync", 1), ("start", 30, 1, 103), ("train", 2),
        ("collect", 30, 1), ("sync", 2), ("start", 40, 2, 104), ("train", 3),
        ("collect", 40, 2), ("sync", 3), ("train", 4)]  # nothing started past the last step
    assert [m["async/staleness/max"] for m in metrics] == [0, 1, 1, 1]
    assert [m["async/weight_version"] for m in metrics] == [0, 1, 2, 3]
    assert metrics[1]["async/num_stale_samples"] == 2 and "timing_s/update_weights" in metrics[1] and "timing_s/gen" in metrics[1]


def test_staleness_zero_is_the_synchronous_order():
    p, rollout, _ = _pipeline(0)
    metrics = [_train(p, rollout, step)[1] for step in range(1, 4)]
    assert rollout.calls == [
        ("start", 10, 0, 101), ("collect", 10, 0), ("train", 1),
        ("sync", 1), ("start", 20, 1, 102), ("collect", 20, 1), ("train", 2),
        ("sync", 2), ("start", 30, 2, 103), ("collect", 30, 2), ("train", 3)]
    assert all(m["async/staleness/max"] == 0 for m in metrics)


def test_samples_carry_their_weight_version():
    p, rollout, _ = _pipeline(1)
    _train(p, rollout, 1)
    samples, _ = _train(p, rollout, 2)
    assert [s.extra["weight_version"] for s in samples] == [0, 0]


def test_checkpoint_saves_the_loader_before_the_batch_in_flight_and_resume_regenerates_it():
    p, rollout, loader = _pipeline(1)
    _train(p, rollout, 1)
    _train(p, rollout, 2)  # batch 3 (prompts 30) in flight
    assert loader.state_dict() == {"epoch": 0, "step_in_epoch": 3}
    assert p.loader_state() == {"epoch": 0, "step_in_epoch": 2}  # a resume draws batch 3 again
    state = p.state_dict()
    # resume: a fresh pipeline, the loader restored, the loaded actor synced by the trainer
    q, rollout2, loader2 = _pipeline(1)
    loader2.i = p.loader_state()["step_in_epoch"]
    rollout2.actor_weights = rollout2.engine_weights = 2
    q.load_state_dict(state)
    _, m = _train(q, rollout2, 3)
    assert rollout2.calls[:2] == [("start", 30, 2, 103), ("collect", 30, 2)]  # regenerated, from the resumed actor
    assert m["async/staleness/max"] == 0


def test_validation_waits_for_the_batch_in_flight_and_syncs():
    p, rollout, _ = _pipeline(1)
    _train(p, rollout, 1)  # batch 2 in flight, actor updated
    p.quiesce()
    assert rollout.calls[-2:] == [("wait", 20), ("sync", 1)]
    _, m = _train(p, rollout, 2)
    assert m["async/staleness/max"] == 1  # batch 2 still counts from the weights it was generated with


def test_verls_one_step_off_config_composes(tmp_path):
    """verl's verl/experimental/one_step_off_policy/config/one_step_off_ppo_trainer.yaml (its settings) read by
    name: the mode on, bypass mode on, the engine keys and the rollout resource pool accepted."""
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "one_step_off_ppo_trainer.yaml").write_text(textwrap.dedent("""
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - _self_
        rollout:
          nnodes: 1
          n_gpus_per_node: 8
        actor_rollout_ref:
          rollout:
            free_cache_engine: False
            calculate_log_probs: True
        algorithm:
          rollout_correction:
            bypass_mode: True
    """))
    cfg = compose_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"],
                         config_file=conf / "one_step_off_ppo_trainer.yaml")
    assert cfg.trainer.one_step_off_policy.enable is True and cfg.trainer.one_step_off_policy.staleness == 1
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    cfg = compose_config(["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
                          "algorithm.rollout_correction.rollout_is=token",
                          "algorithm.rollout_correction.rollout_is_threshold=2.0"])
    assert cfg.algorithm.rollout_correction.rollout_is == "token" and not cfg.trainer.one_step_off_policy.enable


def test_bad_settings_are_refused_at_cfg():
    from rlhf.config.errors import ConfigValidationError
    from rlhf.config.validate import validate_config

    with pytest.raises(ConfigValidationError, match=r"trainer.one_step_off_policy.staleness=2 must be 0 or 1"):
        validate_config(compose_config(["trainer.one_step_off_policy.staleness=2"]))
    with pytest.raises(ConfigValidationError, match="does not combine with rollout.multi_turn.enable"):
        validate_config(compose_config(["trainer.one_step_off_policy.enable=true", "rollout.multi_turn.enable=true"]))
    with pytest.raises(ConfigValidationError, match="does not combine with algorithm.filter_groups.enable"):
        validate_config(compose_config(["trainer.one_step_off_policy.enable=true", "algorithm=dapo"]))
    with pytest.raises(ConfigValidationError, match="rollout_correction.rollout_is='tok' must be null, token or"):
        validate_config(compose_config(["algorithm.rollout_correction.rollout_is=tok"]))
    with pytest.raises(ConfigValidationError, match="loss_mode=bypass_mode trains against the engine's log-probs"):
        validate_config(compose_config(["actor.policy_loss.loss_mode=bypass_mode"]))
    validate_config(compose_config(["algorithm.rollout_correction.bypass_mode=true"]))  # the way to select it
