"""validate_config: the rules across sections that the schema cannot check (batch sizes against data parallel,
token budgets against the lengths, the engines' placement, rules.yaml ``across``) and the distillation teacher and,
with ``check_files``, the run's surroundings (:mod:`rlhf.preflight`), all problems together.  No network, no torch.
"""
from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from rlhf.algorithms import registry
from rlhf.config.choices import GROUP_ESTIMATORS, choice_problem
from rlhf.config.errors import ConfigValidationError
from rlhf.config.schema import field_problems
from rlhf.config.schema.rules import rule_problems, table
from rlhf.preflight import critic_on, distill_problems, preflight_problems, surroundings
from rlhf.rollout.placement import placement_problems, trainer_world_size


def token_budget_problem(what: str, max_tokens: Optional[int], max_prompt_length: int,
                         max_response_length: int) -> Optional[str]:
    """The problem of a dynamic-batching token budget (tokens per micro batch, key ``what``) that a sequence of the
    configured lengths may not fit, with the smallest value that works; None when it fits."""
    need = max_prompt_length + max_response_length
    if max_tokens is not None and max_tokens >= need:
        return None
    return (f"{what}={max_tokens} is below data.max_prompt_length + data.max_response_length = {need}: a sequence "
            f"could fit in no micro batch; set {what} >= {need} (verl users typically use 2-3x that), or turn "
            f"dynamic batching off")


def _token_budgets(cfg: DictConfig) -> list[str]:
    """The dynamic-batching token budgets (one whole prompt + response each), which the ranks would refuse after the
    launch."""
    p, r, out = cfg.data.max_prompt_length, cfg.data.max_response_length, []
    critic = [("critic", "forward_max_token_len_per_gpu")] * critic_on(cfg)
    for role, forward in [("actor", "log_prob_max_token_len_per_gpu"), *critic]:
        for key in ("ppo_max_token_len_per_gpu", forward) if cfg[role].use_dynamic_bsz else ():
            if key == "ppo_max_token_len_per_gpu" or cfg[role][key] is not None:  # null: the update's budget
                problem = token_budget_problem(f"{role}.{key}", cfg[role][key], p, r)
                out += [problem + "."] if problem else []
    return out


def _batch_sizes(cfg: DictConfig, world_size: Optional[int]) -> list[str]:
    """Mini batches divide the train batch, and mini batch x rollout.n splits over data parallel (no check of the
    micro batch: the workers shrink it to a divisor of the local batch)."""
    world_size, out, source = trainer_world_size(cfg, world_size)
    tp, pp, cp = (cfg.parallel[f"{k}_parallel_size"] for k in ("tensor_model", "pipeline_model", "context"))
    dp: Optional[int] = None
    if world_size is not None and min(tp, pp, cp) >= 1:
        mp, cp_part = tp * pp * cp, f" x parallel.context_parallel_size={cp}" if cp != 1 else ""
        layout = f"parallel.tensor_model_parallel_size={tp}{cp_part} x parallel.pipeline_model_parallel_size={pp}"
        if world_size % mp and source:  # the job's keys say how many: name them, and the nearest value that works
            nodes, gpus = cfg.trainer.nnodes or 1, cfg.trainer.n_gpus_per_node
            engines = world_size - gpus * nodes  # 0, or minus the disaggregated engines' GPUs
            fit = min((g for g in range(1, gpus + 2 * mp + 1) if (g * nodes + engines) >= mp
                       and (g * nodes + engines) % mp == 0), key=lambda g: (abs(g - gpus), -g), default=None)
            out.append(f"{layout} = {mp} does not divide the {world_size} trainer GPUs of {source}; set "
                       f"trainer.n_gpus_per_node={fit} ({(fit or 0) * nodes + engines} trainer GPUs, a multiple of "
                       f"{mp}) or change the parallel sizes.")
        elif world_size % mp:
            out.append(f"{layout} = {mp} does not divide the {world_size} trainer processes; launch a multiple of {mp} "
                       f"processes (e.g. torchrun --nproc_per_node={mp}) or change the parallel sizes.")
        else:
            dp = world_size // mp
    tbs, n = cfg.data.train_batch_size, cfg.rollout.n
    for role in ("actor", "critic"):
        mbs = cfg[role].ppo_mini_batch_size
        if mbs < 1 or tbs < 1:
            continue  # the section's own rules report it
        if mbs > tbs:
            out.append(f"{role}.ppo_mini_batch_size={mbs} is larger than data.train_batch_size={tbs}; set "
                       f"{role}.ppo_mini_batch_size to a divisor of {tbs}.")
        elif tbs % mbs:
            near = min((d for d in range(1, tbs + 1) if tbs % d == 0), key=lambda d: abs(d - mbs))
            out.append(f"{role}.ppo_mini_batch_size={mbs} does not divide data.train_batch_size={tbs}; use a divisor "
                       f"such as {role}.ppo_mini_batch_size={near}.")
        elif dp and n >= 1 and (mbs * n) % dp:
            out.append(f"{role}.ppo_mini_batch_size={mbs} x rollout.n={n} = {mbs * n} sequences per mini-batch do not "
                       f"split over data-parallel size {dp}; make ppo_mini_batch_size * rollout.n a multiple of {dp}.")
    return out


def _algorithm(cfg: DictConfig) -> list[str]:
    """The estimator and policy loss by the registries (run-time registrations too), the rules across sections
    (rlhf/config/schema/rules.yaml ``across``), and what the estimator needs."""
    est, n, mode, out = cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.policy_loss.loss_mode, []
    if est not in registry.adv_estimator_names():
        out.append(choice_problem("algorithm.adv_estimator", est, registry.adv_estimator_names()))
    if mode not in registry.policy_loss_names() and str(mode).replace("-", "_") not in registry.policy_loss_names():
        out.append(choice_problem("actor.policy_loss.loss_mode", mode, registry.policy_loss_names(),
                                  hint="see docs/algorithms.md"))
    out += rule_problems(cfg, table()["across"])
    if cfg.algorithm.name == "ppo" and est in GROUP_ESTIMATORS and n < 2:
        out.append(f"algorithm.adv_estimator={est} computes its baseline over the responses of each prompt and needs "
                   f"rollout.n >= 2 (got {n}); set rollout.n=4 or more, or use algorithm.adv_estimator=gae.")
    return out


def config_problems(cfg: DictConfig, world_size: Optional[int] = None, check_files: bool = False,
                    gpus_per_node: Optional[int] = None) -> list[str]:
    """Every problem of ``cfg``, one line each (key, value, why, fix); the arguments as :func:`validate_config`'s."""
    return (field_problems(cfg) + surroundings(cfg) + _token_budgets(cfg) + _batch_sizes(cfg, world_size)
            + _algorithm(cfg) + placement_problems(cfg, world_size, gpus_per_node)
            + distill_problems(cfg, check_files, trainer_world_size(cfg, world_size)[0])
            + (preflight_problems(cfg) if check_files else []))


def validate_config(cfg: DictConfig, world_size: Optional[int] = None, check_files: bool = False,
                    gpus_per_node: Optional[int] = None) -> None:
    """Check what the schema's types cannot (ranges, batch-size divisibility, settings that need each other), all
    problems raised together.

    Args:
        cfg: a config from :func:`rlhf.config.compose_config`.
        world_size: the trainer processes (torchrun / Slurm tasks) when known; None: ``trainer.n_gpus_per_node x
            trainer.nnodes`` (nnodes default 1) when set, less the disaggregated engines' GPUs.
        check_files: also check the data and model references (local paths, a model's architecture; hub names only
            in the local HF cache), the checkpoint to resume from, the logger backends and the data's lengths, all
            before any download (``rlhf.main``, ``rlhf launch`` and ``rlhf.Trainer`` turn it on).
        gpus_per_node: this machine's GPUs, for the placement check when trainer.n_gpus_per_node is null.

    Raises:
        ConfigValidationError: one line per problem, naming the key, its value and the fix.
    """
    problems = config_problems(cfg, world_size, check_files, gpus_per_node)
    if problems:
        raise ConfigValidationError(problems)
