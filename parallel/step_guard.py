"""Bookkeeping around each optimizer step: skipped (non-finite) steps and the gradient circuit breaker.

- A step whose gradient norm is inf/NaN is skipped by `parallel.optim.optimizer_step` (weights
  and optimizer state untouched); `max_consecutive_skipped_steps` skips in a row raise
  `SkippedStepsError` (the run is diverging: every further step would be skipped too).
- Gradient circuit breaker: `breaker.steps` consecutive (finite) steps with a pre-clip grad norm
  above `breaker.grad_norm` restart the LR warm-up (`StepAlignedScheduler.restart_warmup`) and
  return a `BreakerEvent` for the caller to log and count.  The streak then starts over.
  Skipped steps neither extend nor break the streak.

The guard's counters live in the scheduler's `state_dict()` so a resumed run continues them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields


@dataclass
class BreakerConfig:
    """Gradient circuit breaker settings (config `<role>.optim.breaker.*`)."""

    enable: bool = True
    grad_norm: float = 100.0  # threshold on the pre-clip global grad norm
    steps: int = 5  # consecutive steps above the threshold that trigger it
    warmup_steps: int | None = None  # restarted warm-up length; None: lr_warmup_steps, or `steps` if 0

    def problems(self, at: str = "") -> list[str]:
        """One line per bad value, keys prefixed with `at` (e.g. ``"actor.optim.breaker."``); works on an
        OmegaConf node of this type too."""
        out = []
        if self.enable and not (self.grad_norm is not None and self.grad_norm > 0 and self.steps is not None
                                and self.steps >= 1):
            out.append(f"{at}grad_norm={self.grad_norm}, {at}steps={self.steps}: need grad_norm > 0 and steps >= 1 "
                       f"(or {at}enable=false).")
        if self.warmup_steps is not None and self.warmup_steps < 1:
            out.append(f"{at}warmup_steps={self.warmup_steps}: must be >= 1, or null (the role's lr_warmup_steps).")
        return out


def guard_problems(max_consecutive_skipped_steps, breaker, at: str = "") -> list[str]:
    """Problems of the step-guard keys of a role's optim section (`at` e.g. ``"actor.optim."``); `breaker`
    (BreakerConfig or mapping) None: not checked."""
    out = []
    if max_consecutive_skipped_steps is None or max_consecutive_skipped_steps < 1:
        out.append(f"{at}max_consecutive_skipped_steps={max_consecutive_skipped_steps}: must be >= 1.")
    if breaker is None:
        return out
    if isinstance(breaker, Mapping):
        breaker = BreakerConfig(**dict(breaker))
    return out + BreakerConfig.problems(breaker, f"{at}breaker.")


@dataclass
class StepGuardConfig:
    """Step safety settings (config `<role>.optim.max_consecutive_skipped_steps`, `<role>.optim.breaker`)."""

    max_consecutive_skipped_steps: int = 10
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self):
        if isinstance(self.breaker, Mapping):
            self.breaker = BreakerConfig(**dict(self.breaker))
        problems = guard_problems(self.max_consecutive_skipped_steps, self.breaker)
        if problems:
            raise ValueError(" ".join(problems))

    @classmethod
    def from_optim(cls, optim: Mapping) -> "StepGuardConfig":
        """From a role's `optim` config mapping (dict or OmegaConf); absent keys keep the defaults."""
        kw = {f.name: optim[f.name] for f in fields(cls) if f.name in optim and optim[f.name] is not None}
        return cls(**kw)


class SkippedStepsError(RuntimeError):
    """Too many consecutive optimizer steps were skipped for a non-finite gradient norm."""


def check_consecutive_skips(consecutive: int, limit: int, role: str = "actor") -> None:
    """Raise SkippedStepsError when `consecutive` skipped steps reach `limit` (>= 1)."""
    if consecutive >= limit:
        raise SkippedStepsError(
            f"{role}: {consecutive} consecutive optimizer steps were skipped because the gradient norm was "
            f"inf/NaN ({role}.optim.max_consecutive_skipped_steps={limit}). Weights are unchanged since the "
            "last finite step. Look for inf/NaN in the loss inputs (rewards, advantages, log-probs), lower "
            f"{role}.optim.lr, or resume from the last checkpoint.")


@dataclass
class BreakerEvent:
    """The circuit breaker fired after optimizer step `step` (steps taken, 1-based)."""

    step: int
    grad_norms: list  # the `breaker.steps` grad norms that triggered it
    threshold: float
    warmup_steps: int  # length of the restarted warm-up


class StepGuard:
    """Counts skipped steps and runs the circuit breaker for one optimizer (see module docstring)."""

    def __init__(self, cfg: StepGuardConfig, role: str = "actor", lr_warmup_steps: int = 0):
        self.cfg, self.role = cfg, role
        b = cfg.breaker
        self.breaker_warmup_steps = b.warmup_steps or (lr_warmup_steps if lr_warmup_steps > 0 else b.steps)
        self.consecutive_skips = 0
        self.num_skipped_steps = 0  # over the whole run
        self.num_breaker_events = 0  # over the whole run
        self.streak: list[float] = []  # grad norms of the current run of steps above the threshold

    def record(self, grad_norm: float, skipped: bool, scheduler) -> BreakerEvent | None:
        """Account one optimizer step (after the scheduler was stepped for it).

        Raises SkippedStepsError on the `max_consecutive_skipped_steps`-th skip in a row.
        Returns a BreakerEvent when the breaker fires (it has restarted `scheduler`'s warm-up).
        """
        if skipped:
            self.consecutive_skips += 1
            self.num_skipped_steps += 1
            check_consecutive_skips(self.consecutive_skips, self.cfg.max_consecutive_skipped_steps, self.role)
            return None
        self.consecutive_skips = 0
        b = self.cfg.breaker
        if not b.enable or not math.isfinite(grad_norm):
            return None
        if grad_norm <= b.grad_norm:
            self.streak = []
            return None
        self.streak.append(float(grad_norm))
        if len(self.streak) < b.steps:
            return None
        event = BreakerEvent(step=scheduler.num_steps, grad_norms=self.streak, threshold=b.grad_norm,
                             warmup_steps=self.breaker_warmup_steps)
        self.streak = []
        self.num_breaker_events += 1
        scheduler.restart_warmup(self.breaker_warmup_steps)
        return event

    def state_dict(self) -> dict:
        return {"consecutive_skips": self.consecutive_skips, "num_skipped_steps": self.num_skipped_steps,
                "num_breaker_events": self.num_breaker_events, "streak": list(self.streak)}

    def load_state_dict(self, sd: dict) -> None:
        self.consecutive_skips = sd.get("consecutive_skips", 0)
        self.num_skipped_steps = sd.get("num_skipped_steps", 0)
        self.num_breaker_events = sd.get("num_breaker_events", 0)
        self.streak = list(sd.get("streak", []))
