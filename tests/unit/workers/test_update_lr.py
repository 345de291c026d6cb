"""actor/lr and critic/lr are the LR the update used (verl reads it before scheduler.step(1)), not the next
step's: MegatronActor.update_policy on a stand-in megatron optimizer, with the real optimizer_step and
StepAlignedScheduler (parallel.optim, parallel.lr_schedule); the values are hand-computed."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from parallel.lr_schedule import build_scheduler
from parallel.optim import StepResult, TrainState, optimizer_step
from rlhf.workers import actor as actor_module
from rlhf.workers.actor import MegatronActor
from rlhf.workers.worker import step_metrics


class _Optimizer:
    """What guarded_megatron_step calls on megatron's optimizer: finite gradients, every step taken."""

    chained_optimizers: list = []

    def __init__(self):
        self.param_groups = [{}]

    def prepare_grads(self):
        return False  # no fp16 overflow

    def get_grad_norm(self):
        return 1.0

    def step_with_ready_grads(self):
        return True


def _actor(monkeypatch, optimizer_steps_per_update: int, **schedule):
    opt = _Optimizer()
    sched = build_scheduler(opt, lr=1.0, min_lr=0.0, weight_decay=0.0, **schedule)
    actor = object.__new__(MegatronActor)
    actor.device = torch.device("cpu")  # the role's device (its batch door moves batches there)
    actor.state, actor.moe, actor.update_budget, actor.temperature = TrainState([], opt, sched), None, None, 1.0
    actor.bundle = SimpleNamespace(spec=SimpleNamespace(vocab_size=8))
    actor.cfg = SimpleNamespace(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, ppo_epochs=1, shuffle=False)
    actor.train_mini_batches = lambda *a, **k: ([], [optimizer_step(actor.state)
                                                    for _ in range(optimizer_steps_per_update)])
    monkeypatch.setattr(actor_module, "gather_metrics", lambda per_micro, *a: {})  # no process group here
    return actor


def _lrs(actor, updates: int) -> list[float]:
    loss = SimpleNamespace(keys=(), micro_group=1, needs_entropy=False)
    return [actor.update_policy({"prompt_length": 1}, loss, step=s)["actor/lr"] for s in range(1, updates + 1)]


def test_actor_lr_is_the_lr_of_the_update_warmup_then_cosine(monkeypatch):
    """Bug: actor/lr was read from the param groups after the scheduler stepped: the next update's LR.
    W=2, cosine over D=4 steps from 1.0: steps 1, 2 at 1/2, 1 (warm-up), step k > 2 at
    0.5 * (cos(pi * (k-1-2) / 2) + 1): 1.0, 0.5; step 5 at min_lr 0."""
    actor = _actor(monkeypatch, 1, warmup_steps=2, decay_steps=4, decay_style="cosine")
    assert _lrs(actor, 5) == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0], abs=1e-12)


def test_actor_lr_two_optimizer_steps_per_update_linear(monkeypatch):
    """Two mini batches per update: actor/lr is the LR of the update's last optimizer step.  W=1, linear over
    D=5 optimizer steps: step 1 at 1.0, step k > 1 at 1 - (k-2)/4 -> steps 2, 4, 6 at 1.0, 0.5, 0.0."""
    actor = _actor(monkeypatch, 2, warmup_steps=1, decay_steps=5, decay_style="linear")
    assert _lrs(actor, 3) == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)


def test_the_last_update_of_a_run_long_decay_is_not_at_lr_zero(monkeypatch):
    """lr_decay_steps = the run's 3 updates, no warm-up, cosine to 0: the last update at 0.25, not 0."""
    actor = _actor(monkeypatch, 1, warmup_steps=0, decay_steps=3, decay_style="cosine")
    lrs = _lrs(actor, 3)
    assert lrs == pytest.approx([1.0, 0.5 * (math.cos(math.pi / 3) + 1), 0.5 * (math.cos(2 * math.pi / 3) + 1)])
    assert lrs[-1] == pytest.approx(0.25)


def test_step_metrics_report_the_role_lr_of_the_last_step():
    steps = [StepResult(skipped=False, grad_norm=2.0, lr=0.3), StepResult(skipped=True, grad_norm=math.inf, lr=0.2)]
    m = step_metrics("critic", steps)
    assert m["critic/lr"] == 0.2 and m["critic/num_skipped_steps"] == 1.0
