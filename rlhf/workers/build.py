"""Build the trainer's parts from the composed config: model path, tokenizer, HF config, the megatron
actor / reference / critic with their optimizers.  Collective where noted (every trainer rank calls)."""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from parallel.models import build_model_chunks
from parallel.offload import RoleOffload
from parallel.optim import OptimConfig, build_train_state

from .actor import MegatronActor
from .critic import MegatronCritic
from .dynamic_batch import check_token_budget, token_budgets
from .lora_reference import AdapterOffReference, lora_settings

__all__ = ["fetch_hub_models", "resolve_model_path", "load_tokenizer", "load_hf_config", "optim_config", "check_dynamic_batching",
           "build_actor",
           "build_reference", "build_critic", "resolve_reward_paths", "attach_offload", "offload_parts"]

logger = logging.getLogger(__name__)
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fetch_hub_models(cfg) -> list[str]:
    """Download every hub model the config names (``model.path``, ``model.critic_path``, ``model.tokenizer_path``,
    model reward sources: weights, configs, tokenizer) into the local HF cache, on every rank BEFORE the process
    group exists: no rank waits in a collective, under its watchdog, while another downloads.  The ranks of a node
    share its cache: huggingface_hub's file locks let one of them fetch each file (with its progress bar) while the
    others wait for the lock, and a file already there is not fetched again.  Returns the repo ids fetched."""
    from rlhf.data.refs import parse_model_ref

    refs = [cfg.model.path, cfg.model.critic_path, cfg.model.tokenizer_path,
            *[s.path for s in cfg.reward.sources or [] if s.type == "model"]]
    hub = list(dict.fromkeys(r for r in refs if r and parse_model_ref(r).kind == "hub"))
    if hub:
        from huggingface_hub import snapshot_download

        for repo in hub:
            snapshot_download(repo, allow_patterns=_HUB_PATTERNS)
    return hub


def resolve_model_path(cfg, path: str | None = None) -> str:
    """`path` (default ``model.path``; the critic's and reward models' take the same references) as a local
    directory: quickstart URIs through the quickstart hook (rlhf.quickstart.resolve, collective), a hub name from
    the local hub cache (fetched before the process group by :func:`fetch_hub_models`; fetched now when not)."""
    from rlhf.quickstart.resolve import resolve_model

    path = resolve_model(cfg, path)
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=_HUB_PATTERNS)
    return path


def load_tokenizer(cfg, model_path: str):
    """``model.tokenizer_path`` (default the model's): an HF directory or hub name, or ``object://tokenizer/<n>``
    (a tokenizer object given to rlhf.Trainer, rlhf.config.objects); a tokenizer without a pad token pads
    with EOS."""
    from transformers import AutoTokenizer

    from rlhf.config.objects import get_object, is_object_ref

    ref = cfg.model.tokenizer_path
    tokenizer = get_object(ref) if is_object_ref(ref) else AutoTokenizer.from_pretrained(ref or model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_hf_config(path: str):
    """The HF model config (config.json) at `path`."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def optim_config(cfg_optim) -> OptimConfig:
    """parallel.optim.OptimConfig from a config ``optim`` section (its fields, by name)."""
    return OptimConfig(**{k: cfg_optim[k] for k in OptimConfig.__dataclass_fields__ if k in cfg_optim})


def model_config_kwargs(cfg) -> dict:
    """The TransformerConfig settings of the config (``parallel.*`` besides the process-group sizes, and
    ``model.moe_*``) as keyword arguments of :func:`parallel.models.build_model_chunks` /
    :func:`parallel.model_config.transformer_config_from_hf`."""
    p = cfg.parallel
    return dict(make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                params_dtype=_DTYPES[cfg.model.dtype], sequence_parallel=p.sequence_parallel, recompute=p.recompute,
                num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
                num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage,
                account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
                account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
                moe_aux_loss_coeff=cfg.model.moe_aux_loss_coef, moe_z_loss_coeff=cfg.model.moe_z_loss_coeff,
                moe_router_dtype=cfg.model.moe_router_dtype,
                moe_token_dispatcher_type=cfg.model.get("moe_token_dispatcher_type", "alltoall"),
                moe_enable_deepep=bool(cfg.model.get("moe_enable_deepep", False)))


def routing_replay_on(cfg, hf_config) -> bool:
    """Whether the actor records / replays MoE routing (parallel.router_replay): ``actor.router_replay.mode`` R2 or
    R3, or the engines return their routing (``rollout.enable_rollout_routing_replay``: `moe/routing_agreement`).
    Raises ConfigValidationError (rlhf.main: exit 2) for a model without MoE layers then, before any model is built;
    ``--cfg`` with check_files refuses it already (rlhf.preflight.routing_replay_problems)."""
    from parallel.model_config import hf_model_spec
    from rlhf.config.errors import ConfigValidationError
    from rlhf.preflight import routing_replay_message

    mode = cfg.actor.get("router_replay", {}).get("mode", "disabled")
    engines = bool(cfg.rollout.get("enable_rollout_routing_replay"))
    on = mode != "disabled" or engines
    if on and not hf_model_spec(hf_config).is_moe:
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        raise ConfigValidationError([routing_replay_message(mode, engines, cfg.model.path, arch)])
    return on


def _chunks(cfg, hf_config, role: str, path: str, section, **extra):
    """Collective. The role's model chunks with their initial weights: the HF safetensors at `path`, or with
    ``<section>.use_dist_checkpointing`` the megatron dist checkpoint ``<section>.dist_checkpointing_path`` (any
    layout; its padded vocabulary kept: parallel.init_checkpoint).  `extra`: more TransformerConfig settings."""
    kwargs = {**model_config_kwargs(cfg), **extra}
    from parallel.distributed import compute_device
    from parallel.preflight import check_token_dispatcher

    problems = check_token_dispatcher(kwargs["moe_token_dispatcher_type"], kwargs["moe_enable_deepep"],
                                      compute_device().type)
    if problems:  # also for runs not started by rlhf.main (rlhf.api.Trainer): before the model is built
        raise ValueError(problems[0])
    if not section.get("use_dist_checkpointing"):
        return build_model_chunks(hf_config, role, path, **kwargs)
    from parallel.init_checkpoint import load_model_weights, vocab_multiple

    ckpt = section.dist_checkpointing_path
    kwargs["make_vocab_size_divisible_by"] = vocab_multiple(ckpt, cfg.parallel.tensor_model_parallel_size)
    bundle = build_model_chunks(hf_config, role, None, **kwargs)
    load_model_weights(ckpt, bundle.chunks, role=role)
    if dist.get_rank() == 0:
        logger.info("%s: initial weights from the megatron dist checkpoint %s (config.json from %s)", role, ckpt,
                    path)
    return bundle


def check_dynamic_batching(cfg, role: str) -> None:
    """With ``<role>.use_dynamic_bsz``: each token budget of the role holds the longest sequence the data
    allows (rlhf.workers.dynamic_batch.check_token_budget) and no virtual pipeline stages are set; ValueError
    naming the key otherwise."""
    section = cfg[role]
    forward_key = "log_prob_max_token_len_per_gpu" if role == "actor" else "forward_max_token_len_per_gpu"
    forward, update = token_budgets(section, forward_key)
    vpp = cfg.parallel.get("virtual_pipeline_model_parallel_size")
    if update is not None and vpp and vpp > 1:
        raise ValueError(f"{role}.use_dynamic_bsz=true cuts micro batches of different shapes, which megatron's "
                         f"interleaved schedule (parallel.virtual_pipeline_model_parallel_size={vpp}) cannot run; "
                         f"unset one of them")
    for key, value in ((forward_key, forward), ("ppo_max_token_len_per_gpu", update)):
        if value is not None:
            check_token_budget(f"{role}.{key}", value, cfg.data.max_prompt_length, cfg.data.max_response_length)


def attach_offload(worker, parts, role: str):
    """Give `worker` (a MegatronWorker) a parallel.offload.RoleOffload of its enabled `parts` (names of
    parallel.offload.PARTS; none: no offload) on its device, and offload them now; returns the worker."""
    parts = [p for p in parts if p]
    if parts:
        state = worker.state
        worker.offload = RoleOffload(state.model if state is not None else worker.chunks,
                                     state.optimizer if state is not None else None, worker.device, parts, role)
        worker.offload.offload()
    return worker


def offload_parts(section) -> list[str]:
    """``<role>.offload`` (params / grads / optimizer flags) -> the names switched on."""
    off = section.get("offload")
    return [] if off is None else [k for k in ("params", "grads", "optimizer") if off.get(k)]


def build_actor(cfg, hf_config, model_path: str, *, temperature: float) -> MegatronActor:
    """Collective. The actor from the HF weights at `model_path` (or ``actor.dist_checkpointing_path`` with
    ``actor.use_dist_checkpointing``), with its optimizer (``actor.optim``).
    With ``model.lora.rank`` > 0 the base weights are frozen and LoRA adapters (parallel.lora) are what the
    optimizer trains; ``actor.lora`` holds their settings (None without LoRA).
    Raises ValueError for a dynamic-batching token budget below the longest sequence, before building."""
    check_dynamic_batching(cfg, "actor")
    replay = routing_replay_on(cfg, hf_config)
    bundle = _chunks(cfg, hf_config, "actor", model_path, cfg.actor,
                     **({"moe_enable_routing_replay": True} if replay else {}))
    settings = lora_settings(cfg)
    if settings is not None:
        from parallel.lora import apply_lora

        apply_lora(bundle.chunks, settings)
    actor = MegatronActor(bundle, build_train_state(bundle.chunks, bundle.config, optim_config(cfg.actor.optim)),
                          cfg.actor, temperature=temperature,
                          router_replay=cfg.actor.get("router_replay", {}).get("mode", "disabled"))
    actor.lora = settings
    return attach_offload(actor, offload_parts(cfg.actor), "actor")


def build_reference(cfg, hf_config, model_path: str, *, temperature: float, actor: MegatronActor | None = None):
    """Collective. The frozen reference policy (the actor's initial weights, from the same source; no optimizer;
    its parameters offloaded between its forwards with ``actor.ref_param_offload``).  With LoRA
    (``model.lora.rank`` > 0) it is `actor` with its adapters off (AdapterOffReference: no second copy of the
    weights); ValueError when `actor` is not given then."""
    if lora_settings(cfg) is not None:
        if actor is None:
            raise ValueError("model.lora.rank > 0: the reference is the actor with its adapters off; pass actor=")
        return AdapterOffReference(actor)
    ref = MegatronActor(_chunks(cfg, hf_config, "reference", model_path, cfg.actor), None, cfg.actor,
                        temperature=temperature)
    return attach_offload(ref, ["params" if cfg.actor.get("ref_param_offload") else None], "reference")


def resolve_reward_paths(cfg):
    """Collective. A copy of the ``reward`` section whose model sources' paths are local directories, resolved
    like the actor's (:func:`resolve_model_path`: tiny://quickstart, hub names, local directories)."""
    from omegaconf import OmegaConf

    reward = OmegaConf.create(OmegaConf.to_container(cfg.reward, resolve=True))
    for src in reward.sources:
        if src.type == "model" and src.path:
            src.path = resolve_model_path(cfg, src.path)
    return reward


def build_critic(cfg, model_path: str) -> MegatronCritic:
    """Collective. The critic from ``model.critic_path`` (resolved like the actor's: HF directory, hub name,
    tiny://quickstart; default the actor's weights; or ``critic.dist_checkpointing_path`` with
    ``critic.use_dist_checkpointing``; the value head is freshly initialised), with its optimizer
    (``critic.optim``).  Raises ValueError for a dynamic-batching token budget below the longest sequence."""
    check_dynamic_batching(cfg, "critic")
    critic_path = resolve_model_path(cfg, cfg.model.critic_path) if cfg.model.critic_path else model_path
    bundle = _chunks(cfg, load_hf_config(critic_path), "critic", critic_path, cfg.critic)
    state = build_train_state(bundle.chunks, bundle.config, optim_config(cfg.critic.optim), role="critic")
    critic = MegatronCritic(bundle, state, cfg.critic,
                            forward_micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_gpu)
    return attach_offload(critic, offload_parts(cfg.critic), "critic")
