"""Validate a composed config: the rules that span sections (batch sizes against the data-parallel size,
an estimator against rollout.n, ...), the ones that look outside the config (the algorithm registries, a
reward file, a local model's context length), and every section's own rules
(:func:`rlhf.config.schema.field_problems`), all reported together in one :class:`ConfigValidationError`.

Types and fixed choices were already checked by OmegaConf while composing (:mod:`rlhf.config.compose`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from rlhf.config.choices import GROUP_ESTIMATORS, choice_problem
from rlhf.config.errors import ConfigValidationError
from rlhf.config.schema import field_problems

__all__ = ["validate_config", "config_problems"]


def _valid_adv_estimators() -> list[str]:
    from rlhf.algorithms.advantages import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator

    return sorted(set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator})


def _context_length(cfg: DictConfig) -> list[str]:
    """When model.path is a local HF directory, prompt + response must fit its max_position_embeddings
    (SGLang refuses a longer context)."""
    path = cfg.model.path
    cfg_file = Path(str(path)) / "config.json" if path and "://" not in str(path) else None
    if cfg_file is None or not cfg_file.is_file():
        return []
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    max_pos = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get("max_position_embeddings")
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    if isinstance(max_pos, int) and p + r > max_pos:
        return [f"data.max_prompt_length={p} + data.max_response_length={r} = {p + r} exceeds the model's "
                f"max_position_embeddings={max_pos} ({cfg_file}); lower them so they fit."]
    return []


def _batch_sizes(cfg: DictConfig, world_size: Optional[int]) -> list[str]:
    """Mini batches must divide the train batch, and mini batch x rollout.n must split over data parallel."""
    out: list[str] = []
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    dp: Optional[int] = None
    if world_size is not None and tp >= 1 and pp >= 1:
        if world_size % (tp * pp) != 0:
            out.append(f"parallel.tensor_model_parallel_size={tp} x parallel.pipeline_model_parallel_size={pp} = "
                       f"{tp * pp} does not divide the {world_size} trainer processes; launch a multiple of {tp * pp} "
                       f"processes (e.g. torchrun --nproc_per_node={tp * pp}) or change the parallel sizes.")
        else:
            dp = world_size // (tp * pp)
    tbs, n = cfg.data.train_batch_size, cfg.rollout.n
    for role in ("actor", "critic"):
        mbs = cfg[role].ppo_mini_batch_size
        if mbs < 1 or tbs < 1:
            continue  # reported by the section's own rules
        if mbs > tbs:
            out.append(f"{role}.ppo_mini_batch_size={mbs} is larger than data.train_batch_size={tbs}; "
                       f"set {role}.ppo_mini_batch_size to a divisor of {tbs}.")
        elif tbs % mbs != 0:
            near = min((d for d in range(1, tbs + 1) if tbs % d == 0), key=lambda d: abs(d - mbs))
            out.append(f"{role}.ppo_mini_batch_size={mbs} does not divide data.train_batch_size={tbs}; "
                       f"use a divisor such as {role}.ppo_mini_batch_size={near}.")
        # No check for the micro batch: the workers shrink it to a divisor of the local batch.
        elif dp and n >= 1 and (mbs * n) % dp != 0:
            out.append(f"{role}.ppo_mini_batch_size={mbs} x rollout.n={n} = {mbs * n} sequences per mini-batch do "
                       f"not split over data-parallel size {dp}; make ppo_mini_batch_size * rollout.n a multiple "
                       f"of {dp}.")
    return out


def _algorithm(cfg: DictConfig) -> list[str]:
    out: list[str] = []
    est, n = cfg.algorithm.adv_estimator, cfg.rollout.n
    valid = _valid_adv_estimators()
    if est not in valid:
        out.append(choice_problem("algorithm.adv_estimator", est, valid))
    if cfg.critic.enable is False and est == "gae":
        out.append("critic.enable=false but algorithm.adv_estimator=gae needs a critic (value function); set "
                   "critic.enable=null/true, or pick a critic-free estimator such as algorithm.adv_estimator=grpo.")
    if cfg.algorithm.name == "ppo" and est in GROUP_ESTIMATORS and n < 2:
        out.append(f"algorithm.adv_estimator={est} computes its baseline over the responses of each prompt and "
                   f"needs rollout.n >= 2 (got {n}); set rollout.n=4 or more, or use algorithm.adv_estimator=gae.")
    rpath = cfg.reward.custom_reward_function.path
    if rpath and not Path(rpath).is_file():
        out.append(f"reward.custom_reward_function.path={rpath!r} is not a file (relative to the working directory "
                   f"{os.getcwd()}); give the path of a .py file defining "
                   f"{cfg.reward.custom_reward_function.name}(data_source, solution_str, ground_truth, extra_info).")
    return out


def config_problems(cfg: DictConfig, world_size: Optional[int] = None) -> list[str]:
    """Every problem of ``cfg`` (one line each: key, value, why, fix): the sections' own rules first, then
    the rules across sections.  ``world_size`` enables the data-parallel checks (see validate_config)."""
    return field_problems(cfg) + _context_length(cfg) + _batch_sizes(cfg, world_size) + _algorithm(cfg)


def validate_config(cfg: DictConfig, world_size: Optional[int] = None) -> None:
    """Check what the schema's types cannot: ranges, batch-size divisibility, settings that need each other.
    All problems are collected and raised together.

    Args:
        cfg: a config from :func:`rlhf.config.compose_config`.
        world_size: number of trainer processes (torchrun / Slurm tasks) when known; enables the checks
            that depend on the data-parallel size ``world_size / (tp * pp)``.

    Raises:
        ConfigValidationError: one line per problem, naming the key, its value and the fix.
    """
    problems = config_problems(cfg, world_size)
    if problems:
        raise ConfigValidationError(problems)

