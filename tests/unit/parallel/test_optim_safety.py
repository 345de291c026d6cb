"""LR warm-up convention, gradient circuit breaker and skip counting, on megatron's scheduler with a stand-in
optimizer (only param_groups are read).

The megatron-backed checks (inf-gradient step is a bitwise no-op, distributed-optimizer resume is
bitwise, slim checkpoint size) run under torchrun: tests/support/dist/optim_safety_checks.py.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from parallel.lr_schedule import build_scheduler
from parallel.step_guard import (BreakerConfig, SkippedStepsError, StepGuard, StepGuardConfig,
                                   check_consecutive_skips)


def make_scheduler(lr=1.0, warmup=4, decay_steps=None, style="constant", min_lr=0.0):
    opt = SimpleNamespace(param_groups=[{}, {}])
    return opt, build_scheduler(opt, lr=lr, min_lr=min_lr, weight_decay=0.0, warmup_steps=warmup,
                                decay_steps=decay_steps, decay_style=style)


def run_lrs(opt, sched, n, guard=None, grad_norms=None):
    """LRs used by n successful steps, stepping the scheduler after each like optimizer_step."""
    used, events = [], []
    for i in range(n):
        used.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == used[-1]
        sched.step(1)
        if guard is not None:
            events.append(guard.record(grad_norms[i], False, sched))
    return used, events


def test_warmup_first_step_is_not_wasted():
    # W=4, peak 1.0: steps 1..4 use 1/4, 2/4, 3/4, 4/4; then constant
    opt, sched = make_scheduler(lr=1.0, warmup=4)
    used, _ = run_lrs(opt, sched, 6)
    assert used == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_linear_decay_hand_values():
    # W=2, D=6, min_lr=0.1: step k>2 runs at megatron's position k-1, 0.1 + 0.9 * (1 - (k-1-2)/4); step 7 at min
    opt, sched = make_scheduler(lr=1.0, warmup=2, decay_steps=6, style="linear", min_lr=0.1)
    used, _ = run_lrs(opt, sched, 8)
    expect = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.25, 0.1, 0.1]
    assert used == pytest.approx(expect, abs=1e-15)


def test_no_warmup_is_constant_from_step_one():
    opt, sched = make_scheduler(lr=3e-6, warmup=0)
    assert run_lrs(opt, sched, 3)[0] == [3e-6] * 3


def test_cosine_decay_hand_values():
    opt, sched = make_scheduler(lr=2.0, warmup=1, decay_steps=3, style="cosine")
    used, _ = run_lrs(opt, sched, 4)
    # step 1: warm-up end (2.0); step 2: position 1, ratio 0 (2.0); step 3: ratio 1/2 -> 2 * 0.5 * (cos(pi/2) + 1)
    # = 1.0; step 4: ratio 1 -> min_lr 0
    assert used == pytest.approx([2.0, 2.0, 1.0, 0.0], abs=1e-15)


def test_decay_over_the_run_leaves_the_last_update_above_min_lr():
    """Bug: with lr_decay_steps = the run's steps and min_lr=0 the last update ran at LR 0 (a wasted step).
    Now step k > W runs at megatron's position k - 1, as verl's workers do (they read the LR, then step(1)):
    4 steps, no warm-up, cosine from 1.0: 0.5 * (cos(pi * (k-1) / 4) + 1)."""
    opt, sched = make_scheduler(lr=1.0, warmup=0, decay_steps=4, style="cosine")
    used, _ = run_lrs(opt, sched, 5)
    expect = [1.0, 0.5 * (math.cos(math.pi / 4) + 1), 0.5, 0.5 * (math.cos(3 * math.pi / 4) + 1), 0.0]
    assert used == pytest.approx(expect, abs=1e-12)
    assert used[3] == pytest.approx(0.1464466, abs=1e-7)  # the run's last step: above 0
    # linear, W=2, D=5: steps 3..5 at 1 - (k-1-2)/3: 1, 2/3, 1/3; step 6 at 0
    opt, sched = make_scheduler(lr=1.0, warmup=2, decay_steps=5, style="linear")
    assert run_lrs(opt, sched, 6)[0] == pytest.approx([0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0], abs=1e-12)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_matches_verls_use_of_megatrons_scheduler(style):
    """verl (verl/workers/megatron_workers.py update_actor) logs and uses param_groups' LR, then calls
    scheduler.step(1): step k runs at f(k-1) of a plain OptimizerParamScheduler (init_lr 0).  Ours equals it
    after the warm-up, and is one step ahead during it (no step at LR 0)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    W, D, n = 3, 10, 12
    verl_opt = SimpleNamespace(param_groups=[{}])
    verl = OptimizerParamScheduler(verl_opt, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=W,
                                   lr_decay_steps=D, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=1, wd_incr_style="constant")
    verl_lrs = []
    for _ in range(n + 1):
        verl_lrs.append(verl_opt.param_groups[0]["lr"])
        verl.step(1)
    opt, sched = make_scheduler(lr=1.0, warmup=W, decay_steps=D, style=style)
    ours = run_lrs(opt, sched, n)[0]
    assert verl_lrs[0] == 0.0 and ours[:W] == pytest.approx(verl_lrs[1:W + 1], abs=1e-15)
    assert ours[W:] == pytest.approx(verl_lrs[W:n], abs=1e-15)
    assert ours[D - 1] > 0.0 and ours[D] == 0.0  # step D (the last of the decay) above min_lr, D + 1 at it


def test_scheduler_state_round_trip_keeps_next_lr():
    opt, sched = make_scheduler(lr=1.0, warmup=4)
    run_lrs(opt, sched, 2)
    sched.restart_warmup(2)
    sd = sched.state_dict()
    opt2, sched2 = make_scheduler(lr=1.0, warmup=4)
    run_lrs(opt2, sched2, 1)  # a scheduler that already moved: load must not add to its count
    sched2.load_state_dict(sd)
    assert sched2.num_steps == 2 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.75 * 0.5


@pytest.mark.parametrize("style", ["constant", "cosine"])
def test_scheduler_state_loads_with_weights_only(style):
    """The state goes into dist_checkpointing's common state, which torch.load reads with weights_only=True:
    an LRDecayStyle member (pickled as a call to str) was refused, so every resume failed."""
    import io

    import torch

    from parallel.optim_config import LRDecayStyle

    opt, sched = make_scheduler(style=LRDecayStyle(style), decay_steps=10)
    buf = io.BytesIO()
    torch.save({"scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["scheduler"]
    assert type(loaded["lr_decay_style"]) is str and loaded["lr_decay_style"] == style


def test_breaker_restarts_warmup_after_consecutive_spikes():
    # peak 1.0, warm-up 2; breaker: 3 steps above 100 -> warm-up of 4 steps restarts
    opt, sched = make_scheduler(lr=1.0, warmup=2)
    guard = StepGuard(StepGuardConfig(breaker=BreakerConfig(grad_norm=100.0, steps=3, warmup_steps=4)))
    sched.guard = guard
    norms = [1.0, 150.0, 200.0, 50.0, 101.0, 102.0, 103.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    used, events = run_lrs(opt, sched, len(norms), guard, norms)
    fired = [i for i, e in enumerate(events) if e is not None]
    assert fired == [6]  # the 50.0 at step 4 broke the first streak; steps 5, 6, 7 complete one
    ev = events[6]
    assert ev.step == 7 and ev.grad_norms == [101.0, 102.0, 103.0] and ev.warmup_steps == 4
    # steps 1-7 unaffected (0.5, 1, ...); steps 8..11 ramp 1/4..4/4 of the peak; step 12 at peak
    assert used == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert guard.num_breaker_events == 1 and guard.state_dict()["streak"] == []


def test_breaker_warmup_default_and_disable():
    assert StepGuard(StepGuardConfig(), lr_warmup_steps=7).breaker_warmup_steps == 7
    assert StepGuard(StepGuardConfig(breaker=BreakerConfig(steps=3)), lr_warmup_steps=0).breaker_warmup_steps == 3
    opt, sched = make_scheduler(lr=1.0, warmup=0)
    guard = StepGuard(StepGuardConfig(breaker={"enable": False}))
    _, events = run_lrs(opt, sched, 8, guard, [1e6] * 8)
    assert events == [None] * 8 and opt.param_groups[0]["lr"] == 1.0


def test_breaker_during_decay_multiplies_the_schedule():
    # linear decay 1.0 -> 0 over 10 steps, no warm-up: step k at 1 - (k-1)/10; breaker (2 steps > 10, warm-up 2)
    # fires at step 2: step 3 at half its 0.8
    opt, sched = make_scheduler(lr=1.0, warmup=0, decay_steps=10, style="linear")
    guard = StepGuard(StepGuardConfig(breaker=BreakerConfig(grad_norm=10.0, steps=2, warmup_steps=2)))
    used, events = run_lrs(opt, sched, 5, guard, [11.0, 12.0, 1.0, 1.0, 1.0])
    assert events[1] is not None
    assert used == pytest.approx([1.0, 0.9, 0.8 * 0.5, 0.7, 0.6], abs=1e-15)


def test_consecutive_skips_raise_clear_error():
    opt, sched = make_scheduler()
    guard = StepGuard(StepGuardConfig(max_consecutive_skipped_steps=3), role="critic")
    guard.record(math.inf, True, sched)
    guard.record(math.nan, True, sched)
    guard.record(1.0, False, sched)  # a finite step resets the run
    guard.record(math.inf, True, sched)
    guard.record(math.inf, True, sched)
    msg = r"critic: 3 consecutive .*critic\.optim\.max_consecutive_skipped_steps=3"
    with pytest.raises(SkippedStepsError, match=msg):
        guard.record(math.inf, True, sched)
    assert guard.num_skipped_steps == 5
    check_consecutive_skips(2, 3)
    with pytest.raises(SkippedStepsError):
        check_consecutive_skips(3, 3)


def test_skipped_steps_do_not_feed_breaker():
    opt, sched = make_scheduler(lr=1.0, warmup=0)
    guard = StepGuard(StepGuardConfig(breaker=BreakerConfig(grad_norm=10.0, steps=2, warmup_steps=2)))
    assert guard.record(20.0, False, sched) is None
    assert guard.record(math.inf, True, sched) is None  # skipped: streak kept, not extended
    assert guard.record(30.0, False, sched) is not None


def test_guard_config_from_optim_mapping():
    from omegaconf import OmegaConf

    optim = OmegaConf.create({"lr": 1e-6, "max_consecutive_skipped_steps": 3,
                              "breaker": {"grad_norm": 50.0, "steps": 2}})
    cfg = StepGuardConfig.from_optim(optim)
    assert cfg.max_consecutive_skipped_steps == 3
    assert cfg.breaker == BreakerConfig(enable=True, grad_norm=50.0, steps=2, warmup_steps=None)
    assert StepGuardConfig.from_optim({"lr": 1.0}) == StepGuardConfig()


@pytest.mark.parametrize("bad", [dict(max_consecutive_skipped_steps=0), dict(breaker=dict(steps=0)),
                                 dict(breaker=dict(grad_norm=-1.0)), dict(breaker=dict(warmup_steps=0))])
def test_bad_guard_config_is_refused(bad):
    with pytest.raises(ValueError):
        StepGuardConfig(**bad)


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_decay_style='exp'"):
        make_scheduler(style="exp")
    with pytest.raises(ValueError, match="lr_warmup_steps=-1"):
        make_scheduler(warmup=-1)
