"""Validate a composed config: the rules that span sections (batch sizes against the data-parallel size,
an estimator against rollout.n, ...), the ones that look outside the config (the algorithm registries, a
reward file, a local model's context length), every section's own rules
(:func:`rlhf.config.schema.field_problems`), and with ``check_files`` the data and model references
(:mod:`rlhf.config.refs`: local paths exist, a model directory has a readable config.json of a supported
architecture, the checkpoint to resume from exists: :mod:`rlhf.config.resume`), all reported together in one
:class:`ConfigValidationError`.  No network, no torch.

Types and fixed choices were already checked by OmegaConf while composing (:mod:`rlhf.config.compose`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from rlhf.algorithms import registry
from rlhf.config.choices import GROUP_ESTIMATORS, choice_problem
from rlhf.config.errors import ConfigValidationError
from rlhf.config.objects import is_object_ref, unknown_objects
from rlhf.config.refs import cached_hub_file, parse_data_ref, parse_model_ref
from rlhf.config.resume import resume_problems
from rlhf.config.schema import field_problems
from rlhf.rollout.placement import job_placement_problem, trainer_gpus

__all__ = ["validate_config", "config_problems", "placement_problems", "check_model_config", "model_context_length", "token_budget_problem",
           "SUPPORTED_ARCHITECTURES"]

#: architectures the megatron model builder maps (the converter registry, parallel.convert.supported_architectures,
#: which imports torch; tests/unit/config/test_config.py keeps the two equal)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM")


def check_model_config(path: str | os.PathLike, layout: dict | None = None) -> list[str]:
    """Problems of the HF model whose ``config.json`` is at ``path`` (a model directory or the file), from that
    file alone (parallel.preflight.check_model): an architecture the trainer cannot build, a RoPE scaling it
    does not implement, and with ``layout`` (tp, pp, vpp, ep, num_layers_in_first/last_pipeline_stage) a
    parallel layout that does not shard the model.  One line each, without the config key (the caller prefixes
    it); [] when the model is supported or the file cannot be read (the caller's own rules report that)."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    from parallel.convert.spec import UnsupportedModelError
    from parallel.preflight import check_model

    try:
        check_model(str(p.parent), **(layout or {}))
    except (UnsupportedModelError, ValueError) as e:
        return [str(e).rstrip(".")]
    return []


# --------------------------------------------------------------------------- names the algorithms accept


def _valid_adv_estimators() -> list[str]:
    """The built-in estimators and any registered at run time (a user's register_adv_est); torch-free."""
    return registry.adv_estimator_names()


def _valid_loss_modes() -> list[str]:
    """The built-in policy losses and any registered at run time (register_policy_loss); torch-free."""
    return registry.policy_loss_names()


# --------------------------------------------------------------------------- rules across sections


#: sglang/srt/utils/hf_transformers/common.py CONTEXT_LENGTH_KEYS: the config.json keys SGLang derives an
#: engine's longest context from, the first one present wins
ENGINE_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def model_context_length(hf: dict) -> Optional[tuple[int, str]]:
    """(tokens, the config.json key) of the longest context SGLang serves the model with, as SGLang derives it
    (``get_context_length`` of sglang/srt/utils/hf_transformers/common.py, on the text config of a VLM): the
    first of :data:`ENGINE_CONTEXT_KEYS`, times the RoPE scaling ``factor`` unless the scaling names its
    ``original_max_position_embeddings`` or is llama3's.  An engine asked for more refuses to start; None when
    the config has none of the keys."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    key = next((k for k in ENGINE_CONTEXT_KEYS if isinstance(text.get(k), int)), None)
    if key is None:
        return None
    rope = text.get("rope_scaling") or {}
    factor = 1 if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3" else \
        rope.get("factor", 1)
    return int(factor * text[key]), key


def _model_config_file(path: Any) -> Optional[Path]:
    """config.json of a local model directory or of a hub model already in the HF cache (no network)."""
    ref = parse_model_ref(path) if path and not is_object_ref(str(path)) else None
    if ref is None:
        return None
    return Path(ref.path) / "config.json" if ref.kind == "local" else (
        cached_hub_file(ref.path) if ref.kind == "hub" else None)


def _context_length(cfg: DictConfig) -> list[str]:
    """data.max_prompt_length + data.max_response_length (the rollout engine's context: rlhf.workers.rollout)
    within the model's context (:func:`model_context_length`) when its config.json can be read without the
    network (a local directory, a hub model in the HF cache, tiny://quickstart)."""
    path = cfg.model.path
    ref = parse_model_ref(path) if path and not is_object_ref(str(path)) else None
    if ref is not None and ref.kind == "tiny":
        from rlhf.quickstart.resolve import QUICKSTART_MAX_POSITION_EMBEDDINGS

        ctx, where = (QUICKSTART_MAX_POSITION_EMBEDDINGS, "max_position_embeddings"), str(path)
    else:
        cfg_file = _model_config_file(path)
        try:
            ctx = model_context_length(json.loads(cfg_file.read_text(encoding="utf-8"))) if cfg_file else None
        except (OSError, ValueError):
            ctx = None
        where = str(cfg_file)
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    if ctx is None or p + r <= ctx[0]:
        return []
    n, key = ctx
    fix = (f"set data.max_response_length={n - p} (or lower data.max_prompt_length)" if n - p >= 1 else
           f"set data.max_prompt_length and data.max_response_length to sum to at most {n}")
    return [f"data.max_prompt_length={p} + data.max_response_length={r} = {p + r} exceeds the model's context "
            f"{key}={n} ({where}): the rollout engine refuses a longer context at start-up; {fix}."]


def token_budget_problem(what: str, max_tokens: Optional[int], max_prompt_length: int,
                         max_response_length: int) -> Optional[str]:
    """The problem of a dynamic-batching token budget (tokens per micro batch) that a sequence of the
    configured lengths may not fit, naming `what` (the config key) and the smallest value that works; None
    when it fits."""
    need = max_prompt_length + max_response_length
    if max_tokens is not None and max_tokens >= need:
        return None
    return (f"{what}={max_tokens} is below data.max_prompt_length + data.max_response_length = {need}: a sequence "
            f"could fit in no micro batch; set {what} >= {need} (verl users typically use 2-3x that), or turn "
            f"dynamic batching off")


def _response_sized(cfg: DictConfig) -> list[str]:
    """Settings sized against data.max_response_length that the trainer's ranks would otherwise refuse after
    the launch: the dynamic-batching token budgets (one whole prompt + response each; verl scripts compute them
    from the lengths) and DAPO's overlong buffer (the last tokens before the response limit)."""
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    out = []
    roles = [("actor", "log_prob_max_token_len_per_gpu")] + (
        [("critic", "forward_max_token_len_per_gpu")] if _critic_on(cfg) else [])
    for role, forward_key in roles:
        section = cfg[role]
        if not section.get("use_dynamic_bsz"):
            continue
        for key in ("ppo_max_token_len_per_gpu", forward_key):
            if key == forward_key and section.get(key) is None:
                continue  # null: the update's budget
            problem = token_budget_problem(f"{role}.{key}", section.get(key), p, r)
            out += [problem + "."] if problem else []
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len is not None and not 0 < ob.len <= r:
        out.append(f"reward.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={r}]: the buffer "
                   f"is the last tokens before the response limit; set reward.overlong_buffer.len<={r} (verl's DAPO "
                   f"scripts use a quarter to a half of it), or null for a quarter.")
    return out


def _world_size(cfg: DictConfig, world_size: Optional[int]) -> tuple[Optional[int], list[str]]:
    """The trainer processes: the launcher's, else trainer.n_gpus_per_node x trainer.nnodes (default 1 node)
    less the disaggregated engines' GPUs (what the launchers start)."""
    gpus, nodes = cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes or 1
    declared = gpus * nodes if gpus and gpus >= 1 and nodes >= 1 else None
    if declared is None:
        return world_size, []
    if cfg.rollout.mode != "colocated":
        r = cfg.rollout
        trainer = trainer_gpus(r.mode, declared, r.num_engines, r.tensor_model_parallel_size)
        return (world_size if world_size is not None else trainer if trainer >= 1 else None), []
    if cfg.trainer.nnodes is None:
        return world_size, []
    if world_size is not None and world_size != declared:
        return world_size, [f"trainer.n_gpus_per_node={gpus} x trainer.nnodes={nodes} = {declared} but the job has "
                            f"{world_size} trainer processes; launch {declared} (e.g. torchrun --nproc_per_node={gpus}"
                            f" --nnodes={nodes}) or set both to null (as launched)."]
    return declared if world_size is None else world_size, []


def _batch_sizes(cfg: DictConfig, world_size: Optional[int]) -> list[str]:
    """Mini batches must divide the train batch, and mini batch x rollout.n must split over data parallel."""
    world_size, out = _world_size(cfg, world_size)
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    cp = cfg.parallel.get("context_parallel_size", 1)
    dp: Optional[int] = None
    if world_size is not None and min(tp, pp, cp) >= 1:
        mp = tp * pp * cp
        cp_part = f" x parallel.context_parallel_size={cp}" if cp != 1 else ""
        if world_size % mp != 0:
            out.append(f"parallel.tensor_model_parallel_size={tp}{cp_part} x parallel.pipeline_model_parallel_size={pp} = "
                       f"{mp} does not divide the {world_size} trainer processes; launch a multiple of {mp} "
                       f"processes (e.g. torchrun --nproc_per_node={mp}) or change the parallel sizes.")
        else:
            dp = world_size // mp
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


def _placement(cfg: DictConfig, world_size: Optional[int], gpus_per_node: Optional[int]) -> list[str]:
    """The engines and trainer ranks fit the job's GPUs (rlhf/rollout/placement.py): colocated engines on
    trainer rank 0's node, disaggregated ones on the GPUs the trainer leaves.  The GPUs: trainer.n_gpus_per_node
    x trainer.nnodes (``gpus_per_node``, this machine's GPUs at the start of a run, when n_gpus_per_node is
    null; trainer.nnodes null: the nodes the trainer's ranks fill); no check without a GPU count, nor for
    disaggregated engines of a job as launched on several nodes (they may run on Ray nodes beyond the
    trainer's)."""
    r, t = cfg.rollout, cfg.trainer
    if min(r.num_engines, r.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) < 1:
        return []  # reported by the section's own rules
    declared = t.n_gpus_per_node if t.n_gpus_per_node and t.n_gpus_per_node >= 1 else None
    per_node = declared or gpus_per_node
    if not per_node or (t.nnodes is not None and t.nnodes < 1) or r.mode not in ("colocated", "disaggregated"):
        return []
    nnodes = t.nnodes or (-(-world_size // per_node) if world_size else 1)
    if r.mode == "disaggregated" and not t.nnodes and nnodes > 1:
        return []
    src = (f"{'trainer.nnodes' if t.nnodes else 'nodes'} x "
           f"{'trainer.n_gpus_per_node' if declared else 'GPUs per node (trainer.n_gpus_per_node=null)'}")
    why = job_placement_problem(mode=r.mode, num_engines=r.num_engines, engine_tp=r.tensor_model_parallel_size,
                                gpus_per_node=per_node, nnodes=nnodes, trainer_world_size=world_size,
                                pp=cfg.parallel.pipeline_model_parallel_size,
                                ep=cfg.parallel.get("expert_model_parallel_size", 1), gpus_from=src)
    return [why] if why else []


def placement_problems(cfg: DictConfig) -> list[str]:
    """The placement problems of ``cfg`` as composed (the GPUs it declares, launcher unknown): see _placement."""
    return _placement(cfg, None, None)


def _critic_on(cfg: DictConfig) -> bool:
    enable = cfg.critic.enable
    return bool(enable) if enable is not None else cfg.algorithm.adv_estimator == "gae"


def _algorithm(cfg: DictConfig) -> list[str]:
    out: list[str] = []
    est, n = cfg.algorithm.adv_estimator, cfg.rollout.n
    valid = _valid_adv_estimators()
    if est not in valid:
        out.append(choice_problem("algorithm.adv_estimator", est, valid))
    mode, modes = cfg.actor.policy_loss.loss_mode, _valid_loss_modes()
    if mode not in modes and str(mode).replace("-", "_") not in modes:
        out.append(choice_problem("actor.policy_loss.loss_mode", mode, modes, hint="see docs/algorithms.md"))
    if cfg.critic.enable is False and est == "gae":
        out.append("critic.enable=false but algorithm.adv_estimator=gae needs a critic (value function); set "
                   "critic.enable=null/true, or pick a critic-free estimator such as algorithm.adv_estimator=grpo.")
    if cfg.algorithm.name == "ppo" and est in GROUP_ESTIMATORS and n < 2:
        out.append(f"algorithm.adv_estimator={est} computes its baseline over the responses of each prompt and "
                   f"needs rollout.n >= 2 (got {n}); set rollout.n=4 or more, or use algorithm.adv_estimator=gae.")
    if cfg.trainer.critic_warmup > 0 and not _critic_on(cfg):
        out.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} trains only the critic first, but this run has "
                   f"no critic (algorithm.adv_estimator={est}, critic.enable={cfg.critic.enable}); set "
                   f"trainer.critic_warmup=0.")
    rpath = cfg.reward.custom_reward_function.path
    if rpath and not is_object_ref(rpath) and not Path(rpath).is_file():
        out.append(f"reward.custom_reward_function.path={rpath!r} is not a file (relative to the working directory "
                   f"{os.getcwd()}); give the path of a .py file defining "
                   f"{cfg.reward.custom_reward_function.name}(data_source, solution_str, ground_truth, extra_info).")
    return out


# --------------------------------------------------------------------------- files (check_files=True)


def _data_problems(key: str, value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else list(value or [])
    out = []
    for i, item in enumerate(items):
        at = key if isinstance(value, str) else f"{key}[{i}]"
        ref = parse_data_ref(item)
        if ref.kind == "invalid" or (ref.kind == "local" and not ref.exists):
            out.append(f"{at}={item!r}: {ref.why}; give a local .parquet/.jsonl file or directory, a hub dataset "
                       f"such as openai/gsm8k:main@train, or embedded://arithmetic.")
    return out


def _model_problems(key: str, value: Optional[str], architecture: bool = True, layout: dict | None = None) -> list[str]:
    if not value:
        return []
    ref = parse_model_ref(value)
    if ref.kind == "invalid" or (ref.kind in ("local", "tiny") and not ref.exists):
        return [f"{key}={value!r}: {ref.why}."]
    config = None
    if ref.kind == "local":
        config = Path(ref.path) / "config.json"
        if not config.is_file():
            return [f"{key}={value!r} has no config.json; give a Hugging Face model directory (save_pretrained) "
                    f"or a hub name."]
    elif ref.kind == "hub":
        config = cached_hub_file(ref.path)  # only what is already downloaded: no network at start-up
    return [f"{key}={value!r}: {p}." for p in check_model_config(config, layout)] if config and architecture else []


def _local_hf_config(path: Optional[str]):
    """The HF config of a local model directory (or a hub model already in the cache) when supported, else None."""
    config = _model_config_file(path)
    if config is None or not Path(config).is_file():
        return None
    from parallel.model_config import hf_model_spec
    from parallel.preflight import load_hf_config

    try:
        hf_config = load_hf_config(str(Path(config).parent))
        hf_model_spec(hf_config)
    except (ValueError, OSError):  # unsupported or unreadable: model.path's own check says so
        return None
    return hf_config


def _init_weights_problems(cfg: DictConfig) -> list[str]:
    """A role starting from a megatron dist checkpoint (``<role>.use_dist_checkpointing``): the directory exists,
    holds model tensors, and they are the model of the role's config.json (parallel.init_checkpoint)."""
    roles = [("actor", cfg.model.path)]
    if _critic_on(cfg):
        roles.append(("critic", cfg.model.critic_path or cfg.model.path))
    out = []
    for role, model in roles:
        path = cfg[role].dist_checkpointing_path
        if not cfg[role].use_dist_checkpointing or not path:
            continue
        from parallel.init_checkpoint import check_model_checkpoint

        problems = check_model_checkpoint(path, _local_hf_config(model), role=role,
                                          tp=cfg.parallel.tensor_model_parallel_size)
        out += [f"{role}.dist_checkpointing_path={path!r}: {p}." for p in problems]
    return out


def _file_problems(cfg: DictConfig) -> list[str]:
    out = _data_problems("data.train_files", cfg.data.train_files)
    out += _data_problems("data.val_files", cfg.data.val_files)
    p = cfg.parallel
    layout = dict(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                  vpp=p.virtual_pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                  num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
                  num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage,
                  account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
                  account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split)
    out += _model_problems("model.path", cfg.model.path, layout=layout)
    out += _init_weights_problems(cfg)
    if _critic_on(cfg):
        out += _model_problems("model.critic_path", cfg.model.critic_path)
    tok = cfg.model.tokenizer_path
    if tok and not is_object_ref(tok):
        ref = parse_model_ref(tok)
        if ref.kind == "invalid" or (ref.kind == "local" and not ref.exists):
            out.append(f"model.tokenizer_path={tok!r}: {ref.why}.")
    for i, src in enumerate(cfg.reward.sources):
        if src.type == "model":
            out += _model_problems(f"reward.sources[{i}].path", src.path, architecture=False)
        elif src.type == "custom" and src.path and not is_object_ref(src.path) and not Path(src.path).is_file():
            out.append(f"reward.sources[{i}].path={src.path!r} is not a file; give a .py file defining {src.name}.")
    return out + resume_problems(cfg.trainer)


#: trainer.logger backends that need a package of their own: name -> (module, pip extra of setup.py)
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", None), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def _logger_problems(cfg: DictConfig) -> list[str]:
    import importlib.util

    out = []
    for b in cfg.trainer.logger:
        module, extra = LOGGER_PACKAGES.get(str(b), (None, None))
        if module and importlib.util.find_spec(module) is None:
            how = f"pip install 'rlhf-megatron-sglang[{extra}]'" if extra else f"pip install {module}"
            out.append(f"trainer.logger includes {b} but the {module} package is not installed: {how}, or drop {b}.")
    return out


def _object_problems(cfg: DictConfig) -> list[str]:
    refs = [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files),
            ("model.tokenizer_path", cfg.model.tokenizer_path),
            ("reward.custom_reward_function.path", cfg.reward.custom_reward_function.path)]
    refs += [(f"reward.sources[{i}].path", s.path) for i, s in enumerate(cfg.reward.sources)]
    return [f"{key}={uri!r} is not an object of this process: in-process objects (rlhf.Trainer's reward callables, "
            f"datasets, tokenizers) exist only in the Python process that created the Trainer; run Trainer(...).run() "
            f"there, or save the object (Dataset.to_parquet, tokenizer.save_pretrained) and give its path."
            for key, value in refs for uri in unknown_objects(value)]


def config_problems(cfg: DictConfig, world_size: Optional[int] = None, check_files: bool = False,
                    gpus_per_node: Optional[int] = None) -> list[str]:
    """Every problem of ``cfg`` (one line each: key, value, why, fix): the sections' own rules first, then
    the rules across sections, then (``check_files``) the data and model references.  ``world_size``
    enables the data-parallel checks, ``gpus_per_node`` the placement check (see validate_config)."""
    out = field_problems(cfg) + _context_length(cfg) + _response_sized(cfg) + _batch_sizes(cfg, world_size)
    out += _algorithm(cfg)
    out += _placement(cfg, world_size, gpus_per_node)
    out += _object_problems(cfg)
    return out + (_checked_files(cfg) if check_files else [])


def _checked_files(cfg: DictConfig) -> list[str]:
    """The data and model references, the logger packages, then (when the references were found) offline hub
    data, W&B credentials and prompt lengths against the data (rlhf.config.preflight)."""
    from rlhf.config.preflight import preflight_problems

    files = _file_problems(cfg)
    return files + _logger_problems(cfg) + ([] if files else preflight_problems(cfg))


def validate_config(cfg: DictConfig, world_size: Optional[int] = None, check_files: bool = False,
                    gpus_per_node: Optional[int] = None) -> None:
    """Check what the schema's types cannot: ranges, batch-size divisibility, settings that need each other.
    All problems are collected and raised together.

    Args:
        cfg: a config from :func:`rlhf.config.compose_config`.
        world_size: number of trainer processes (torchrun / Slurm tasks) when known; enables the checks
            that depend on the data-parallel size ``world_size / (tp * pp)``.  When None,
            ``trainer.n_gpus_per_node x trainer.nnodes`` (nnodes default 1) is used when set, less the
            disaggregated engines' GPUs (rollout.num_engines x rollout.tensor_model_parallel_size).
        gpus_per_node: this machine's GPUs, for the placement check when trainer.n_gpus_per_node is null
            (``rlhf.main`` passes it at the start of a run).  The placement check: colocated engines fit
            the trainer's GPUs on rank 0's node, disaggregated ones the GPUs the trainer leaves.
        check_files: also check the data and model references (local paths exist, a model directory has a
            config.json of a supported architecture; hub names only against the local HF cache) and that the
            packages of the chosen ``trainer.logger`` backends are installed.  ``rlhf.main``,
            ``rlhf launch`` and ``rlhf.Trainer`` turn it on, so these run before any download.

    Raises:
        ConfigValidationError: one line per problem, naming the key, its value and the fix.
    """
    problems = config_problems(cfg, world_size, check_files, gpus_per_node)
    if problems:
        raise ConfigValidationError(problems)
