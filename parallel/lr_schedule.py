"""LR schedule: megatron-core's OptimizerParamScheduler, evaluated for the step about to be taken,
with a restartable warm-up (the gradient circuit breaker's action).

Convention (1-based optimizer steps k = 1, 2, ...; warm-up of W steps, peak LR `lr`, decay over D steps;
f(i) = megatron's OptimizerParamScheduler.get_lr at num_steps = i):

    lr_k = f(k) = lr * k / W     for k <= W      (step 1 already moves: lr / W; step W at full lr)
    lr_k = f(k - 1)              for k > W       (the decay: step W + 1 at full lr, step D just above
                                                  min_lr, step D + 1 and later at min_lr)

megatron's scheduler stores `num_steps` = steps taken and Megatron-LM (and verl, whose workers read the
LR before ``scheduler.step(1)``: verl/workers/megatron_workers.py update_actor) steps it *after* the
optimizer, so step k runs at f(k - 1).  With init_lr=0 that makes the first warm-up step run at LR 0
(thrown away) and warm-up reach the peak one step late (at step W+1); HF's `get_*_schedule_with_warmup`
start at 0 for the same reason.  Here the warm-up uses f(k), the index of the step the LR is used for:
the ramp of Goyal et al. 2017 ("Accurate, Large Minibatch SGD", sec. 2.2: lr grows by a constant amount
each iteration and reaches the target at the end of the warm-up) without the wasted zero step.  The
decay keeps megatron's / verl's f(k - 1): with ``lr_decay_steps`` = the run's steps the last step still
runs above min_lr (at min_lr = 0 it would otherwise be an update at LR 0); to end exactly at min_lr give
``lr_decay_steps`` = steps - 1.  `num_steps` keeps megatron's meaning (steps taken; old checkpoints load
unchanged).

Warm-up restart: `restart_warmup(w)` after step t multiplies the scheduled LR of step k > t by
min(1, (k - t) / w): the LR ramps up again from lr_k / w and rejoins the schedule (whose decay
position keeps advancing) after w steps.
"""
from __future__ import annotations

from parallel import cpu_patches  # noqa: F401  (before megatron.core)

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402


class StepAlignedScheduler(OptimizerParamScheduler):
    """OptimizerParamScheduler whose warm-up LR for optimizer step k (1-based) is the schedule at k, its decay
    megatron's / verl's (module docstring).

    Step it exactly like megatron's: `step(1)` after each successful optimizer step (skipped steps
    do not advance it).  Extra state (warm-up restart, the attached `guard`'s counters) travels in `state_dict()`.
    """

    def __init__(self, *args, **kwargs):
        self.restart_at: int | None = None  # num_steps when the warm-up was restarted
        self.restart_warmup_steps: int = 0
        self.guard = None  # optional object with state_dict()/load_state_dict() saved alongside (StepGuard)
        super().__init__(*args, **kwargs)

    def restart_factor(self, step: int) -> float:
        """Multiplier in (0, 1] for the 1-based `step` from a restarted warm-up (1.0 without one)."""
        if self.restart_at is None or self.restart_warmup_steps <= 0:
            return 1.0
        return min(1.0, (step - self.restart_at) / self.restart_warmup_steps)

    def get_lr(self, param_group: dict) -> float:
        """LR of the next optimizer step, k = num_steps + 1: megatron's at k during the warm-up, at
        num_steps = k - 1 after it (see module docstring)."""
        k = self.num_steps + 1
        shift = 1 if k <= self.lr_warmup_steps else 0
        self.num_steps += shift
        try:
            base = super().get_lr(param_group)
        finally:
            self.num_steps -= shift
        return base * self.restart_factor(k)

    def restart_warmup(self, warmup_steps: int) -> None:
        """Restart the warm-up now: the next step runs at 1/warmup_steps of its scheduled LR.

        Raises ValueError for warmup_steps < 1.
        """
        if warmup_steps < 1:
            raise ValueError(f"warm-up restart needs warmup_steps >= 1, got {warmup_steps}")
        self.restart_at, self.restart_warmup_steps = self.num_steps, int(warmup_steps)
        self.step(0)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd.update(restart_at=self.restart_at, restart_warmup_steps=self.restart_warmup_steps)
        if self.guard is not None:
            sd["guard"] = self.guard.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        self.restart_at = state_dict.get("restart_at")
        self.restart_warmup_steps = state_dict.get("restart_warmup_steps", 0)
        if self.guard is not None and "guard" in state_dict:
            self.guard.load_state_dict(state_dict["guard"])
        self.num_steps = 0  # megatron's load adds the saved num_steps to the current count
        super().load_state_dict(state_dict)  # ends with step(0): LRs recomputed with the restart


def build_scheduler(optimizer, *, lr: float, min_lr: float, weight_decay: float, warmup_steps: int,
                    decay_steps: int | None, decay_style: str) -> StepAlignedScheduler:
    """Megatron scheduler over `optimizer`'s param groups (LR per the module docstring).

    decay_steps: steps the decay takes: step decay_steps runs just above min_lr, later ones at min_lr
        (None: never decays).
    Raises ValueError for an unknown decay_style or a negative warm-up.
    """
    decay_style = str(getattr(decay_style, "value", decay_style))  # a plain str: the state must load weights_only
    if decay_style not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_decay_style={decay_style!r}: use constant, linear or cosine")
    if warmup_steps < 0:
        raise ValueError(f"lr_warmup_steps={warmup_steps} must be >= 0")
    decay_steps = decay_steps or 1_000_000_000
    return StepAlignedScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=decay_style, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")
