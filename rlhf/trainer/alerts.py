"""Alerts: a warning line with the step when a metric crosses a threshold, and for safeguard events.

    trainer:
      alerts:
        - {metric: actor/entropy, below: 0.05}      # fires when actor/entropy < 0.05
        - {metric: actor/kl, above: 1.0}            # fires when actor/kl > 1.0
        - {metric: critic/score/mean, below: 0.1, above: 0.9}   # outside [0.1, 0.9]

A rule fires at every step whose value is past a threshold, or is NaN / +-inf.  Each firing logs one
warning on rank 0, ``WARNING step <k>: alert <metric>=<value> below <threshold> (...)``, and is
counted: ``alerts/num_fired`` (this step) and ``alerts/total`` (the run so far, kept in checkpoints).
A rule whose metric is absent at the first step is reported once (a misspelt name; ``val/`` metrics
appear only on validation steps and are exempt).

Safeguard events log the same kind of line without any configuration: the gradient circuit breaker
(``<role>/num_breaker_events`` > 0: the LR warm-up restarted) and skipped optimizer steps
(``<role>/num_skipped_steps`` > 0: an inf/NaN gradient norm); their counts are those metrics.
"""
from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

__all__ = ["AlertRule", "Alerts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlertRule:
    """Fire when `metric` < `below` or > `above` (either may be None), or is not finite."""

    metric: str
    below: Optional[float] = None
    above: Optional[float] = None

    def check(self, value: float) -> Optional[str]:
        """The reason this value fires the rule ("below 0.05", "above 1.0", "not finite"), or None."""
        if not math.isfinite(value):
            return "not finite"
        if self.below is not None and value < self.below:
            return f"below {self.below:g}"
        if self.above is not None and value > self.above:
            return f"above {self.above:g}"
        return None


def _events(role_optims: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for role, optim in role_optims.items():
        b = optim.breaker
        out[f"{role}/num_breaker_events"] = (
            f"{role} gradient circuit breaker fired: grad norm above {role}.optim.breaker.grad_norm={b.grad_norm:g} "
            f"for {b.steps} consecutive optimizer steps; the LR warm-up restarted")
        out[f"{role}/num_skipped_steps"] = (
            f"{role} optimizer step(s) skipped: the gradient norm was inf/NaN (weights unchanged; "
            f"{optim.max_consecutive_skipped_steps} in a row stop the run)")
    return out


class Alerts:
    """Checks each step's metrics (see the module docstring).

    rules: AlertRule objects or mappings with keys metric / below / above (``trainer.alerts``).
    role_optims: role name -> its optim config (``cfg.actor.optim``), for the event lines.
    Raises ValueError for a rule without a metric or without a threshold.
    """

    def __init__(self, rules: Iterable = (), role_optims: Optional[Mapping[str, Any]] = None, echo: bool = True):
        self.rules = [r if isinstance(r, AlertRule) else AlertRule(r["metric"], r.get("below"), r.get("above"))
                      for r in rules]
        for i, r in enumerate(self.rules):
            if not r.metric or (r.below is None and r.above is None):
                raise ValueError(f"trainer.alerts[{i}]={r}: give a metric and below and/or above")
        self.events = _events(role_optims or {})
        self.echo = echo  # log the lines (rank 0)
        self.total = 0  # rules fired over the run
        self.last_fired = 0  # rules fired at the last checked step
        self.checked_names = False

    def check(self, metrics: Mapping[str, float], step: int) -> list[str]:
        """The warning lines of this step (logged as warnings when `echo`); adds nothing to `metrics`."""
        lines = []
        if not self.checked_names:
            self.checked_names = True
            for r in self.rules:
                if r.metric not in metrics and not r.metric.startswith("val/"):
                    near = difflib.get_close_matches(r.metric, list(metrics), n=3)
                    lines.append(f"WARNING step {step}: alert on {r.metric!r}: no such metric"
                                 + (f" (did you mean {near}?)" if near else ""))
        fired = 0
        for r in self.rules:
            if r.metric in metrics:
                value = float(metrics[r.metric])
                reason = r.check(value)
                if reason is not None:
                    fired += 1
                    lines.append(f"WARNING step {step}: alert {r.metric}={value:.6g} {reason}")
        for key, text in self.events.items():
            count = metrics.get(key, 0.0)
            if count and count > 0:
                lines.append(f"WARNING step {step}: {text} ({key}={count:g})")
        self.total += fired
        self.last_fired = fired
        if self.echo:
            for line in lines:
                logger.warning(line)
        return lines

    def metrics(self) -> dict:
        """alerts/num_fired (rules fired at the last checked step) and alerts/total (the run so far)."""
        return {"alerts/num_fired": float(self.last_fired), "alerts/total": float(self.total)}

    def state_dict(self) -> dict:
        return {"total": self.total}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.total = int((state or {}).get("total", 0))
