"""validate_config: what the schema's types and sections cannot check, all problems reported together: the rules
across sections (batch sizes against the data-parallel size, an estimator against rollout.n, the engines' placement,
token budgets against the lengths, on-policy distillation's trainer) and, with ``check_files``, the run's surroundings
(:mod:`rlhf.preflight`: data and model references, checkpoints, logger backends, data lengths; the distillation
teacher's tokenizer against the student's, from the files).  No network, no torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from omegaconf import DictConfig

from rlhf.algorithms import registry
from rlhf.config.choices import GROUP_ESTIMATORS, choice_problem
from rlhf.config.errors import ConfigValidationError
from rlhf.config.schema import field_problems
from rlhf.preflight import (SUPPORTED_ARCHITECTURES, check_model_config, critic_on, model_context_length,  # noqa: F401
                            preflight_problems, surroundings)
from rlhf.rollout.placement import job_placement_problem, pool_problems, trainer_gpus


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


def _response_sized(cfg: DictConfig) -> list[str]:
    """The dynamic-batching token budgets (one whole prompt + response each) and DAPO's overlong buffer (tokens
    before the response limit), which the ranks would refuse after the launch."""
    p, r, out = cfg.data.max_prompt_length, cfg.data.max_response_length, []
    critic = [("critic", "forward_max_token_len_per_gpu")] * critic_on(cfg)
    for role, forward in [("actor", "log_prob_max_token_len_per_gpu"), *critic]:
        for key in ("ppo_max_token_len_per_gpu", forward) if cfg[role].use_dynamic_bsz else ():
            if key == "ppo_max_token_len_per_gpu" or cfg[role][key] is not None:  # null: the update's budget
                problem = token_budget_problem(f"{role}.{key}", cfg[role][key], p, r)
                out += [problem + "."] if problem else []
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len is not None and not 0 < ob.len <= r:
        out.append(f"reward.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={r}]: the buffer is "
                   f"the last tokens before the response limit; set reward.overlong_buffer.len<={r} (verl's DAPO "
                   f"scripts use a quarter to a half of it), or null for a quarter.")
    return out


def _world_size(cfg: DictConfig, world_size: Optional[int]) -> tuple[Optional[int], list[str], Optional[str]]:
    """(trainer processes, problems, where they came from): the launcher's (source None), else what the launchers
    start for the job's GPUs, with the keys that say so (for the messages)."""
    gpus, nodes, r = cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes or 1, cfg.rollout
    declared = gpus * nodes if gpus and gpus >= 1 and nodes >= 1 else None
    if declared is None or (world_size is not None and r.get("n_gpus_per_node")):
        return world_size, [], None
    keys = f"trainer.nnodes={nodes} x trainer.n_gpus_per_node={gpus}"
    if r.get("n_gpus_per_node"):  # verl's pools: trainer.* are the trainer's GPUs alone, the engines have their own
        return declared, [], f"{keys} (verl's trainer pool)"
    if r.mode != "colocated":
        trainer = trainer_gpus(r.mode, declared, r.num_engines, r.tensor_model_parallel_size)
        if world_size is not None or trainer < 1:
            return world_size, [], None
        return trainer, [], (f"{keys} less the engines' rollout.num_engines={r.num_engines} x "
                             f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}")
    if cfg.trainer.nnodes is None:
        return world_size, [], None
    if world_size is not None and world_size != declared:
        return world_size, [f"trainer.n_gpus_per_node={gpus} x trainer.nnodes={nodes} = {declared} but the job has "
                            f"{world_size} trainer processes; launch {declared} (e.g. torchrun --nproc_per_node={gpus}"
                            f" --nnodes={nodes}) or set both to null (as launched)."], None
    return (declared, [], keys) if world_size is None else (world_size, [], None)


def _batch_sizes(cfg: DictConfig, world_size: Optional[int]) -> list[str]:
    """Mini batches divide the train batch, and mini batch x rollout.n splits over data parallel (no check of the
    micro batch: the workers shrink it to a divisor of the local batch)."""
    world_size, out, source = _world_size(cfg, world_size)
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


def placement_problems(cfg: DictConfig, world_size: Optional[int] = None,
                       gpus_per_node: Optional[int] = None) -> list[str]:
    """The engines and trainer ranks fit the job's GPUs (rlhf/rollout/placement.py): trainer.n_gpus_per_node (else
    ``gpus_per_node``) x trainer.nnodes (else the nodes the ranks fill); no check without a GPU count, nor for
    disaggregated engines of a job as launched on several nodes (they may run on Ray nodes beyond the trainer's).
    verl's trainer and rollout pools: :func:`~rlhf.rollout.placement.pool_problems`, on nodes of ``gpus_per_node``
    GPUs (known at the start of a run)."""
    r, t = cfg.rollout, cfg.trainer
    if r.get("n_gpus_per_node"):  # the fields' own rules report a size below 1
        return [] if min(r.n_gpus_per_node, r.nnodes or 1, r.tensor_model_parallel_size) < 1 else pool_problems(
            mode=r.mode, num_engines=r.num_engines, engine_tp=r.tensor_model_parallel_size, rollout_nnodes=r.nnodes or 1,
            rollout_per_node=r.n_gpus_per_node, trainer_nnodes=t.nnodes or 1, trainer_per_node=t.n_gpus_per_node,
            gpus_per_node=gpus_per_node)
    declared = t.n_gpus_per_node if t.n_gpus_per_node and t.n_gpus_per_node >= 1 else None
    per_node = declared or gpus_per_node
    if min(r.num_engines, r.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) < 1 or \
            not per_node or (t.nnodes is not None and t.nnodes < 1):
        return []  # the sections' own rules report a bad size
    nnodes = t.nnodes or (-(-world_size // per_node) if world_size else 1)
    if r.mode == "disaggregated" and not t.nnodes and nnodes > 1:
        return []
    src = (f"{'trainer.nnodes' if t.nnodes else 'nodes'} x "
           f"{'trainer.n_gpus_per_node' if declared else 'GPUs per node (trainer.n_gpus_per_node=null)'}")
    why = job_placement_problem(mode=r.mode, num_engines=r.num_engines, engine_tp=r.tensor_model_parallel_size,
                                gpus_per_node=per_node, nnodes=nnodes, trainer_world_size=world_size, gpus_from=src)
    return [why] if why else []


def _algorithm(cfg: DictConfig) -> list[str]:
    """The estimator and policy loss by the registries (run-time registrations too), and what they need."""
    est, n, mode, out = cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.policy_loss.loss_mode, []
    if est not in registry.adv_estimator_names():
        out.append(choice_problem("algorithm.adv_estimator", est, registry.adv_estimator_names()))
    if mode not in registry.policy_loss_names() and str(mode).replace("-", "_") not in registry.policy_loss_names():
        out.append(choice_problem("actor.policy_loss.loss_mode", mode, registry.policy_loss_names(),
                                  hint="see docs/algorithms.md"))
    if cfg.critic.enable is False and est == "gae":
        out.append("critic.enable=false but algorithm.adv_estimator=gae needs a critic (value function); set "
                   "critic.enable=null/true, or pick a critic-free estimator such as algorithm.adv_estimator=grpo.")
    if cfg.algorithm.name == "ppo" and est in GROUP_ESTIMATORS and n < 2:
        out.append(f"algorithm.adv_estimator={est} computes its baseline over the responses of each prompt and needs "
                   f"rollout.n >= 2 (got {n}); set rollout.n=4 or more, or use algorithm.adv_estimator=gae.")
    if cfg.trainer.critic_warmup > 0 and not critic_on(cfg):
        out.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} trains only the critic first, but this run has "
                   f"no critic (algorithm.adv_estimator={est}, critic.enable={cfg.critic.enable}); set "
                   f"trainer.critic_warmup=0.")
    if mode == "bypass_mode" and not cfg.algorithm.rollout_correction.bypass_mode:
        out.append("actor.policy_loss.loss_mode=bypass_mode trains against the engine's log-probs, which the trainer "
                   "puts in place only with algorithm.rollout_correction.bypass_mode=true; set that instead (it "
                   "selects this loss).")
    for other, why in ((cfg.rollout.multi_turn.enable, "rollout.multi_turn.enable=true (the agent loop is not started "
                        "in the background)"), (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable="
                                                "true (dynamic sampling generates several rounds per step)")):
        if cfg.trainer.one_step_off_policy.enable and other:
            out.append(f"trainer.one_step_off_policy.enable=true does not combine with {why}; turn one of them off.")
    return out + _fully_async(cfg)


def _fully_async(cfg: DictConfig) -> list[str]:
    """async_training (rlhf/trainer/fully_async.py): what the rollouter cannot run beside the trainer."""
    a, rc = cfg.async_training, cfg.algorithm.rollout_correction
    if not a.enable:
        return []
    other = {"trainer.one_step_off_policy.enable=true": cfg.trainer.one_step_off_policy.enable,
             "algorithm.filter_groups.enable=true": cfg.algorithm.filter_groups.enable,
             "algorithm.adv_estimator=remax": cfg.algorithm.adv_estimator == "remax"}
    out = [f"async_training.enable=true (fully async) does not combine with {k} (the rollouter streams single "
           f"rounds of prompts and owns the engines); turn one of them off." for k, v in other.items() if v]
    if rc.rollout_is and a.use_rollout_log_probs and not a.compute_prox_log_prob and not rc.bypass_mode:
        out.append(f"algorithm.rollout_correction.rollout_is={rc.rollout_is} with async_training.use_rollout_log_probs="
                   "true and compute_prox_log_prob=false: old_log_probs would be the engine's own, so every IS weight "
                   "is 1; set async_training.compute_prox_log_prob=true (the trainer's log-probs, verl's advice for "
                   "rollout IS) or algorithm.rollout_correction.bypass_mode=true.")
    if a.partial_rollout and cfg.rollout.enable_rollout_routing_replay:
        out.append("async_training.partial_rollout=true with rollout.enable_rollout_routing_replay=true: a request "
                   "continued after a weight sync is prefilled again, so the engine returns the new weights' routing "
                   "for the tokens the old ones sampled; set async_training.partial_rollout=false (requests finish on "
                   "the weights they started on).")
    return out


def vocab_mismatch(student: Mapping[str, int], teacher: Mapping[str, int]) -> Optional[str]:
    """Why the teacher's token -> id map `teacher` cannot score the student's (`student`), or None when they are equal.
    Names the sizes and up to three tokens that differ (missing in the teacher, or another id)."""
    if dict(student) == dict(teacher):
        return None
    differ = [t for t, i in student.items() if teacher.get(t) != i]
    extra = [t for t in teacher if t not in student]
    shown = ", ".join(f"{t!r}: {student[t]} vs {teacher.get(t, 'missing')}" for t in differ[:3]) or \
        ", ".join(f"{t!r} (teacher only)" for t in extra[:3])
    return (f"the teacher's tokenizer is not the student's ({len(student)} tokens vs {len(teacher)}; "
            f"{len(differ)} of the student's tokens have another id or none in the teacher's, e.g. {shown})")


def files_vocab(model_dir: Optional[str]) -> Optional[dict]:
    """The token -> id map of the tokenizer saved in `model_dir` (tokenizer.json, read by HF ``tokenizers``, added
    tokens included; else vocab.json plus added_tokens.json), or None when there is none readable."""
    d = Path(model_dir or "")
    try:
        if model_dir and (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
        if model_dir and (d / "vocab.json").is_file():
            extra = d / "added_tokens.json"
            return {**json.loads((d / "vocab.json").read_text(encoding="utf-8")),
                    **(json.loads(extra.read_text(encoding="utf-8")) if extra.is_file() else {})}
    except Exception:  # noqa: BLE001 - unreadable (tokenizers raises its own Exception type): no check from files
        return None
    return None


def tokenizer_dir(cfg: Any, path: Optional[str]) -> Optional[str]:
    """The local directory of model reference `path`'s tokenizer (a local directory, a built tiny:// model, a hub
    model's snapshot in the local cache), without building or downloading; else None."""
    if not path:
        return None
    from rlhf.data.refs import cached_hub_file, parse_model_ref
    from rlhf.quickstart.resolve import local_model_path

    if local := local_model_path(cfg, path):
        return local
    ref = parse_model_ref(path)
    found = ref.kind == "hub" and (cached_hub_file(ref.path, "tokenizer.json") or cached_hub_file(ref.path,
                                                                                                  "vocab.json"))
    return str(found.parent) if found else None


def distill_problems(cfg: Any, check_files: bool = False, world_size: Optional[int] = None) -> list[str]:
    """Problems of ``distill`` with the rest of the config: only the PPO-family trainer distils; the teacher's own
    grid (``distill.teacher.tensor/pipeline_model_parallel_size``) divides the `world_size` trainer ranks (when known)
    and its data-parallel size the batch; with `check_files` the teacher's tokenizer against the student's
    (``model.tokenizer_path``, else ``model.path``) when both are on disk.  One line each (key, value, why, fix)."""
    d, out = cfg.get("distill"), []
    if d is None or not d.enable:
        return []
    if str(cfg.algorithm.name) == "dpo":
        out.append("distill.enable=true with algorithm.name=dpo: on-policy distillation scores the student's own "
                   "rollouts, which the DPO trainer does not generate; use a PPO-family algorithm (e.g. "
                   "algorithm.adv_estimator=grpo), or set distill.enable=false.")
    out += _teacher_layout(cfg, world_size)
    if check_files and d.teacher.path and teacher_dispatcher_refused(cfg):
        from rlhf.preflight import hf_config_at_hand, model_is_moe

        hf = hf_config_at_hand(d.teacher.path)  # a dense teacher has no dispatcher; unknown here: checked at build
        if hf is not None and model_is_moe(hf):
            out.append(teacher_dispatcher_message(cfg))
    if check_files and d.teacher.path:
        student_ref = cfg.model.tokenizer_path or cfg.model.path
        student, teacher = (files_vocab(tokenizer_dir(cfg, p)) for p in (student_ref, d.teacher.path))
        why = vocab_mismatch(student, teacher) if student is not None and teacher is not None else None
        if why:
            out.append(mismatch_message(d.teacher.path, student_ref, why))
    return out


def mismatch_message(teacher_path: str, student_ref: str, why: str) -> str:
    """The one-line refusal of a teacher whose tokenizer is not the student's."""
    return (f"distill.teacher.path={teacher_path!r}: {why}. On-policy distillation scores the student's sampled "
            f"token ids with the teacher, so both must use the same tokenizer (the student's: {student_ref!r}); pick "
            f"a teacher of the student's tokenizer family (e.g. a larger model of the same family), or set "
            f"distill.enable=false.")


def teacher_layout(cfg: Any) -> Optional[tuple[int, int]]:
    """The teacher's own (tp, pp) when ``distill.teacher.tensor/pipeline_model_parallel_size`` differ from the
    trainer's ``parallel.*`` (null: the trainer's size), else None (the teacher is sharded like the actor)."""
    t, p = cfg.distill.teacher, cfg.parallel
    tp = t.get("tensor_model_parallel_size") or p.tensor_model_parallel_size
    pp = t.get("pipeline_model_parallel_size") or p.pipeline_model_parallel_size
    return None if (tp, pp) == (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) else (tp, pp)


def teacher_dispatcher_refused(cfg: Any) -> bool:
    """Whether a MoE teacher on a grid of its own (:func:`teacher_layout`; expert parallel size 1 there,
    parallel.layouts) would run megatron-core's flex dispatcher at TP x EP = 1, which it refuses when the model is
    built (megatron-core 0.16.1 token_dispatcher.py MoEFlexTokenDispatcher: 'Flex token dispatcher requires TPxEP >
    1'; its TP is the expert tensor parallel size, the teacher's TP)."""
    layout = teacher_layout(cfg)
    return layout is not None and layout[0] < 2 and cfg.model.get("moe_token_dispatcher_type") == "flex"


def teacher_dispatcher_message(cfg: Any) -> str:
    """The one-line refusal of :func:`teacher_dispatcher_refused`, naming the keys and the fixes."""
    t, p = cfg.distill.teacher, cfg.parallel
    tp = t.tensor_model_parallel_size
    tp = tp if tp is not None else f"null (parallel.tensor_model_parallel_size={p.tensor_model_parallel_size})"
    return (f"model.moe_token_dispatcher_type=flex with the MoE teacher distill.teacher.path={t.path!r} on a grid of "
            f"its own (distill.teacher.tensor_model_parallel_size={tp}, distill.teacher.pipeline_model_parallel_size="
            f"{t.pipeline_model_parallel_size}): that grid has expert parallel size 1, so TP x EP = 1 there, and "
            f"megatron-core's flex dispatcher needs more than one ('Flex token dispatcher requires TPxEP > 1'); set "
            f"distill.teacher.tensor_model_parallel_size > 1, or both distill.teacher sizes to null (the teacher "
            f"sharded like the actor, with its expert parallelism), or model.moe_token_dispatcher_type=alltoall.")


def _teacher_layout(cfg: Any, world_size: Optional[int]) -> list[str]:
    layout = teacher_layout(cfg)
    if layout is None or world_size is None or min(layout) < 1:
        return []  # the fields' own rules report a size below 1
    tp, pp = layout
    keys = (f"distill.teacher.tensor_model_parallel_size={tp} x distill.teacher.pipeline_model_parallel_size={pp}"
            " (null: the parallel.* size)")
    if world_size % (tp * pp):
        return [f"{keys} = {tp * pp} does not divide the {world_size} trainer ranks the teacher runs on; choose "
                f"sizes whose product divides {world_size}, or null for the trainer's."]
    dp, n = world_size // (tp * pp), cfg.data.train_batch_size * cfg.rollout.n
    if n % dp:
        return [f"{keys}: the teacher's data-parallel size {dp} does not divide the batch of data.train_batch_size x "
                f"rollout.n = {n} sequences it scores; make that a multiple of {dp} or change the teacher's sizes."]
    return []


def _routing_replay(cfg: DictConfig) -> list[str]:
    """MoE routing replay (parallel.router_replay): what R2 / R3 need and what they do not combine with."""
    mode = cfg.actor.router_replay.mode
    engines = bool(cfg.rollout.enable_rollout_routing_replay)
    out = []
    if mode == "R3" and not engines:
        out.append("actor.router_replay.mode=R3 replays the engines' routing, which they return only with "
                   "rollout.enable_rollout_routing_replay=true (verl: actor_rollout_ref.rollout."
                   "enable_rollout_routing_replay=True); set it, or use mode R2.")
    if mode == "disabled" and not engines:
        return out
    what = f"actor.router_replay.mode={mode}" if mode != "disabled" else "rollout.enable_rollout_routing_replay=true"
    if cfg.parallel.context_parallel_size > 1:
        out.append(f"{what} with parallel.context_parallel_size={cfg.parallel.context_parallel_size} is not supported"
                   f" (the routing is not split into context-parallel chunks); set context_parallel_size=1.")
    if engines and cfg.rollout.multi_turn.enable:
        out.append("rollout.enable_rollout_routing_replay=true with rollout.multi_turn.enable=true is not supported "
                   "(a multi-turn response spans several engine requests); turn one of them off.")
    return out


def _token_dispatcher(cfg: DictConfig) -> list[str]:
    """MoE token dispatcher (model.moe_token_dispatcher_type / moe_enable_deepep): what megatron-core 0.16.1 refuses
    when the model is built (transformer_config.py: DeepEP only with flex; token_dispatcher.py
    MoEFlexTokenDispatcher: TP x EP > 1).  CUDA and the deep_ep package are checked at start
    (parallel.preflight.check_token_dispatcher)."""
    m, p, out = cfg.model, cfg.parallel, []
    if m.moe_enable_deepep and m.moe_token_dispatcher_type != "flex":
        out.append(f"model.moe_enable_deepep=true needs model.moe_token_dispatcher_type=flex (megatron's DeepEP "
                   f"backend is only supported with the flex dispatcher), not {m.moe_token_dispatcher_type!r}; set "
                   f"it to flex, or drop moe_enable_deepep.")
    if m.moe_token_dispatcher_type == "flex" and p.tensor_model_parallel_size * p.expert_model_parallel_size < 2:
        out.append("model.moe_token_dispatcher_type=flex exchanges tokens over the TP x EP ranks and needs more than "
                   "one (megatron-core: 'Flex token dispatcher requires TPxEP > 1'); set parallel."
                   "expert_model_parallel_size > 1, or use alltoall.")
    return out


#: sglang.Engine arguments the rollout sets from the config (rlhf/workers/rollout.py: rollout_engine_config), so
#: rollout.engine_kwargs.sglang refuses them: the key that sets each, or why nothing may
_PLACED = ("the placement plan gives each engine its device and GPUs, one engine of rollout.tensor_model_parallel_size "
           "GPUs on one node, and the weight sync expects that layout; for more replicas raise the engine count "
           "instead")
ENGINE_OWNED = {
    "model_path": "actor_rollout_ref.model.path", "tp_size": "rollout.tensor_model_parallel_size",
    "dtype": "rollout.dtype", "mem_fraction_static": "rollout.mem_fraction_static",
    "context_length": "data.max_prompt_length + data.max_response_length", "random_seed": "trainer.seed",
    "max_total_tokens": "rollout.max_total_tokens", "enable_memory_saver": "rollout.enable_memory_saver",
    "skip_tokenizer_init": (None, "the weight sync's token-in / token-out mode needs it"),
    "custom_weight_loader": (None, "the weight sync loads each bucket through its own loader"),
    "load_format": (None, "the engines start from the model path's weights and the weight sync replaces them; dummy "
                          "weights would serve the first generation unsynced"),
    **{k: (None, _PLACED) for k in ("device", "base_gpu_id", "gpu_id_step", "dp_size", "pp_size", "ep_size", "nnodes",
                                    "node_rank", "dist_init_addr", "enable_dp_attention")},
    **{k: (None, "each engine takes free ports of its own; a fixed one collides between engines")
       for k in ("port", "nccl_port", "host")}}


def engine_kwargs_problems(cfg: DictConfig) -> list[str]:
    """``rollout.engine_kwargs.sglang``: each key a field of SGLang's ServerArgs (imports sglang, only when set) and
    not one the rollout sets from the config (:data:`ENGINE_OWNED`)."""
    given = [str(k) for k in cfg.rollout.engine_kwargs.sglang]
    if not given:
        return []
    import difflib

    from sglang.srt.server_args import ServerArgs  # a msgspec Struct in SGLang 0.5.2x, a dataclass before

    fields, out = list(getattr(ServerArgs, "__struct_fields__", None) or ServerArgs.__dataclass_fields__), []
    for k in given:
        key, owner = f"rollout.engine_kwargs.sglang.{k}", ENGINE_OWNED.get(k)
        if isinstance(owner, tuple):
            out.append(f"{key} cannot be set here ({owner[1]}); drop it.")
        elif owner:
            out.append(f"{key} is set from the config here; set {owner} instead.")
        elif k not in fields:
            near = difflib.get_close_matches(k, fields, n=3, cutoff=0.6)
            out.append(f"{key}: {k!r} is not a field of SGLang's ServerArgs (sglang.srt.server_args); "
                       + (f"did you mean {', '.join(near)}?" if near else "see python -m sglang.launch_server --help."))
    return out


def config_problems(cfg: DictConfig, world_size: Optional[int] = None, check_files: bool = False,
                    gpus_per_node: Optional[int] = None) -> list[str]:
    """Every problem of ``cfg``, one line each (key, value, why, fix); the arguments as :func:`validate_config`'s."""
    return (field_problems(cfg) + surroundings(cfg) + _response_sized(cfg) + _batch_sizes(cfg, world_size)
            + _algorithm(cfg) + _routing_replay(cfg) + _token_dispatcher(cfg) + placement_problems(cfg, world_size, gpus_per_node)
            + engine_kwargs_problems(cfg) + distill_problems(cfg, check_files, _world_size(cfg, world_size)[0])
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
