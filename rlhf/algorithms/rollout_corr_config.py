"""The torch-free part of rollout correction (``algorithm.rollout_correction``): the option names and the parsing
of ``rollout_rs`` / ``rollout_rs_threshold`` (verl's _parse_rollout_rs_thresholds, verl/trainer/ppo/
rollout_corr_helper.py), read by config validation (which imports no torch) and by rlhf.algorithms.rollout_rs."""
from __future__ import annotations

from typing import Any, Optional

from rlhf.algorithms.config_access import config_get

__all__ = ["ROLLOUT_IS_LEVELS", "BYPASS_LOSS_TYPES", "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
           "rs_options", "parse_rollout_rs_thresholds", "rollout_correction_enabled"]

ROLLOUT_IS_LEVELS = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def rollout_correction_enabled(rc: Any) -> bool:
    """Whether ``algorithm.rollout_correction`` `rc` asks for anything: IS weights, rejection or bypass mode."""
    return rc is not None and (config_get(rc, "rollout_is") is not None or config_get(rc, "rollout_rs") is not None
                               or bool(config_get(rc, "bypass_mode", False)))


SUPPORTED_ROLLOUT_RS_OPTIONS = frozenset({
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"})
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS = frozenset({"token_k1", "token_k2", "token_k3"})


def rs_options(rollout_rs: str) -> list[str]:
    """The comma-separated options of ``rollout_rs``, deduplicated in order.  Raises ValueError naming an unknown
    option (and listing the supported ones) or an empty string."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    out: list[str] = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option: {opt}. "
                             f"Must be one of {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}.")
        if opt not in out:
            out.append(opt)
    if not out:
        raise ValueError("rollout_rs must contain at least one valid option.")
    return out


def parse_rollout_rs_thresholds(options: list[str], threshold_spec) -> dict[str, dict[str, Optional[float]]]:
    """verl's _parse_rollout_rs_thresholds: one threshold for all `options` or one per option (comma separated);
    k1 options get {"lower", "upper"} (``"lower_upper"``, or u -> 1/u, u), others {"lower": None, "upper"}.
    Raises ValueError for a missing, malformed or non-positive threshold; TypeError for another type."""
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(threshold_spec, (int, float)) and not isinstance(threshold_spec, bool):
        raw = [str(threshold_spec)]
    elif isinstance(threshold_spec, str):
        raw = [p.strip() for p in threshold_spec.split(",") if p.strip()]
    else:
        raise TypeError("rollout_rs_threshold must be a string or numeric value specifying per-option thresholds.")
    if not raw:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(raw) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold expects either one threshold shared by all options or exactly "
                         f"{len(options)} thresholds to match the provided rollout_rs options.")
    if len(raw) == 1:
        raw = raw * len(options)
    out: dict[str, dict[str, Optional[float]]] = {}
    for option, spec in zip(options, raw):
        if option.endswith("k1"):
            lower_s, upper_s = spec.split("_", 1) if "_" in spec else (None, spec)
            try:
                upper = float(upper_s)
                lower = float(lower_s) if lower_s is not None else 1.0 / upper
            except (ValueError, ZeroDivisionError) as exc:
                raise ValueError(f"Invalid numeric threshold '{spec}' for option '{option}'.") from exc
            if lower <= 0 or upper <= 0:
                raise ValueError(f"Thresholds for option '{option}' must be positive, got {spec}.")
            out[option] = {"lower": lower, "upper": upper}
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold for option '{option}' must provide a single upper bound "
                                 f"without '_'. Received '{spec}'.")
            try:
                upper = float(spec)
            except ValueError as exc:
                raise ValueError(f"Invalid numeric threshold '{spec}' for option '{option}'.") from exc
            if upper <= 0:
                raise ValueError(f"Threshold for option '{option}' must be positive, got {spec}.")
            out[option] = {"lower": None, "upper": upper}
    return out
