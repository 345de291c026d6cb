"""rlhf/trainer/alerts.py: threshold alerts on step metrics and the safeguard event lines (breaker,
skipped steps): one warning line with the step each, counted in alerts/num_fired and alerts/total."""
from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from rlhf.config import ConfigError, compose_config, validate_config
from rlhf.trainer.alerts import AlertRule, Alerts


def test_thresholds_fire_with_the_step_and_are_counted(caplog):
    alerts = Alerts([{"metric": "actor/entropy", "below": 0.05}, {"metric": "actor/kl", "above": 1.0},
                     AlertRule("critic/score/mean", below=0.1, above=0.9)])
    with caplog.at_level("WARNING", logger="rlhf.trainer.alerts"):
        lines = alerts.check({"actor/entropy": 0.04, "actor/kl": 1.0, "critic/score/mean": 0.5}, step=3)
    assert lines == ["WARNING step 3: alert actor/entropy=0.04 below 0.05"]  # kl == 1.0 is not above 1.0
    assert alerts.metrics() == {"alerts/num_fired": 1.0, "alerts/total": 1.0}
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "WARNING step 3: alert actor/entropy=0.04 below 0.05")]
    lines = alerts.check({"actor/entropy": 0.5, "actor/kl": 1.5, "critic/score/mean": 0.95}, step=4)
    assert lines == ["WARNING step 4: alert actor/kl=1.5 above 1",
                     "WARNING step 4: alert critic/score/mean=0.95 above 0.9"]
    assert alerts.metrics() == {"alerts/num_fired": 2.0, "alerts/total": 3.0}
    assert alerts.check({"actor/entropy": 0.5, "actor/kl": 0.1, "critic/score/mean": 0.5}, step=5) == []
    assert alerts.metrics() == {"alerts/num_fired": 0.0, "alerts/total": 3.0}


def test_non_finite_values_fire():
    alerts = Alerts([{"metric": "actor/kl", "above": 1.0}], echo=False)
    assert alerts.check({"actor/kl": math.nan}, 1) == ["WARNING step 1: alert actor/kl=nan not finite"]
    assert alerts.check({"actor/kl": -math.inf}, 2) == ["WARNING step 2: alert actor/kl=-inf not finite"]


def test_unknown_metric_is_reported_once_and_val_metrics_are_exempt():
    alerts = Alerts([{"metric": "actor/entrpy", "below": 0.1}, {"metric": "val/score", "below": 0.5}], echo=False)
    lines = alerts.check({"actor/entropy": 0.01, "critic/vf_loss": 0.0}, 1)
    assert lines == ["WARNING step 1: alert on 'actor/entrpy': no such metric (did you mean ['actor/entropy']?)"]
    assert alerts.check({"actor/entropy": 0.01}, 2) == []
    assert alerts.check({"val/score": 0.25}, 3) == ["WARNING step 3: alert val/score=0.25 below 0.5"]


def test_safeguard_events_print_without_configuration():
    cfg = compose_config(["actor.optim.breaker.grad_norm=50", "actor.optim.breaker.steps=3"], recipe="quickstart")
    alerts = Alerts([], {"actor": cfg.actor.optim, "critic": cfg.critic.optim}, echo=False)
    lines = alerts.check({"actor/num_breaker_events": 1.0, "actor/num_skipped_steps": 0.0,
                          "critic/num_skipped_steps": 2.0}, 7)
    assert lines == [
        "WARNING step 7: actor gradient circuit breaker fired: grad norm above actor.optim.breaker.grad_norm=50 for 3 "
        "consecutive optimizer steps; the LR warm-up restarted (actor/num_breaker_events=1)",
        "WARNING step 7: critic optimizer step(s) skipped: the gradient norm was inf/NaN (weights unchanged; 10 in a "
        "row stop the run) (critic/num_skipped_steps=2)"]
    assert alerts.metrics()["alerts/num_fired"] == 0  # events are counted by their own metrics


def test_total_survives_a_resume():
    a = Alerts([{"metric": "x", "above": 0}], echo=False)
    a.check({"x": 1.0}, 1)
    a.check({"x": 2.0}, 2)
    b = Alerts([{"metric": "x", "above": 0}], echo=False)
    b.load_state_dict(a.state_dict())
    b.check({"x": 1.0}, 3)
    assert b.metrics() == {"alerts/num_fired": 1.0, "alerts/total": 3.0}
    b.load_state_dict(None)  # a checkpoint from before alerts existed
    assert b.total == 0


def test_alert_config_keys():
    cfg = compose_config(["trainer.alerts=[{metric: actor/entropy, below: 0.05}, {metric: actor/kl, above: 1.0}]"])
    validate_config(cfg)
    assert OmegaConf.to_container(cfg.trainer.alerts) == [{"metric": "actor/entropy", "below": 0.05, "above": None},
                                                          {"metric": "actor/kl", "below": None, "above": 1.0}]
    with pytest.raises(ConfigError, match=r"trainer.alerts\[0\].below and trainer.alerts\[0\].above are both null"):
        validate_config(compose_config(["trainer.alerts=[{metric: actor/kl}]"]))
    with pytest.raises(ConfigError, match=r"trainer.alerts\[0\].metric is empty"):
        validate_config(compose_config(["trainer.alerts=[{above: 1.0}]"]))
    with pytest.raises(ValueError, match="give a metric and below and/or above"):
        Alerts([{"metric": "actor/kl"}])
