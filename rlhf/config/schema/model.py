"""Schema sections of what is trained and how it is laid out: ``data``, ``model`` (with ``model.lora``),
``parallel``, ``actor`` (with ``actor.policy_loss``) and ``critic``.  Names and defaults are verl's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from parallel.optim_config import OptimConfig
from rlhf.config.choices import KLEstimator, LossAggMode, ModelDtype, Recompute, Truncation
from rlhf.config.schema.rules import Checked


@dataclass
class DataConfig(Checked):
    # local parquet/jsonl file(s) or directory, a hub dataset NAME[:CONFIG][@SPLIT] (e.g. openai/gsm8k:main@train;
    # rlhf.data.refs), or embedded://arithmetic; a list mixes them
    train_files: Any = "embedded://arithmetic"
    val_files: Any = "embedded://arithmetic"
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    train_batch_size: int = 8  # prompts per PPO step (each gets rollout.n responses)
    val_batch_size: int = 32
    max_train_samples: Optional[int] = None
    # null: the whole validation set (verl); recipes may cap it
    max_val_samples: Optional[int] = None
    shuffle: bool = True
    seed: int = 1
    # prompts longer than max_prompt_length: dropped (true), else handled by `truncation`
    filter_overlong_prompts: bool = True
    truncation: Truncation = Truncation.error
    apply_chat_template: Optional[bool] = None  # None: on iff the tokenizer has a chat template (off for base models)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra apply_chat_template kwargs
    embedded_num_train: int = 2000  # size of the generated embedded task
    embedded_num_val: int = 64
    embedded_max_operand: int = 9


@dataclass
class LoRAConfig(Checked):
    # LoRA on the actor (parallel.lora): rank 0 = off; the update B A is scaled by alpha / rank; base weights frozen,
    # the reference is the actor with its adapters off
    rank: int = 0
    alpha: float = 16.0
    # all-linear, or a list of HF names (q/k/v and gate/up together) or megatron names (linear_qkv, linear_fc1, ...)
    target_modules: Any = "all-linear"
    a_init: str = "xavier"  # init of A: xavier (verl's megatron default) or kaiming (PEFT's); B starts at 0
    # weight sync (verl's lora.merge, default false like verl's): false = the base weights go to the engines once
    # and every sync after sends only the adapters (SGLang's LoRA, enable_lora); true = W + alpha/r B A every sync
    merge: bool = False

    def rules(self, at: str = "") -> list[str]:
        if not self.rank:
            return []
        from parallel.lora import resolve_targets

        try:
            resolve_targets(self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules))
        except ValueError as e:
            return [f"{at}{e}."]
        return []


@dataclass
class ModelConfig(Checked):
    # HF dir, hub name, or tiny://quickstart (built + warmed up locally; tiny://quickstart-init: before the warm-up)
    path: str = "tiny://quickstart"
    tokenizer_path: Optional[str] = None
    critic_path: Optional[str] = None  # defaults to `path` (value head freshly initialised)
    make_vocab_size_divisible_by: int = 128
    dtype: ModelDtype = ModelDtype.float32
    # MoE: the router's aux (load-balancing) loss coefficient; null: config.json's router_aux_loss_coef, 0: off
    moe_aux_loss_coef: Optional[float] = None
    # MoE: the router z-loss coefficient (ST-MoE, Zoph et al. 2022); null: off
    moe_z_loss_coeff: Optional[float] = None
    # MoE: the dtype of the router's softmax / top-k; null: the model dtype
    moe_router_dtype: Optional[str] = None
    # MoE: how experts exchange tokens: alltoall (megatron's all-to-all), or flex (megatron's fused dispatch /
    # combine over the TP x EP ranks, backend DeepEP: CUDA and the deep_ep package, checked at start)
    moe_token_dispatcher_type: str = "alltoall"
    # MoE: megatron's DeepEP switch (verl's override_transformer_config.moe_enable_deepep); needs flex
    moe_enable_deepep: bool = False
    # tiny://quickstart only: supervised warm-up so PPO starts with some signal
    warmup_steps: int = 300
    warmup_lr: float = 3e-3
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class ParallelConfig(Checked):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    recompute: Optional[Recompute] = None
    # MoE: experts split over this many ranks (divides the data-parallel x tensor-parallel ranks and the experts)
    expert_model_parallel_size: int = 1
    # each rank holds 1/cp of every sequence (GPU with Transformer Engine only); dp = world / (tp * cp * pp)
    context_parallel_size: int = 1
    # uneven pipelines (30 layers at PP4: 6 + 8 + 8 + 8): layers of the first / last stage; null: an even split
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    # count the embedding / the loss as one layer each when splitting the layers over the stages
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False


@dataclass
class OffloadConfig(Checked):
    """What of a role leaves its device while other phases run (parallel.offload; verl's ``<role>.megatron.
    param_offload`` / ``grad_offload`` / ``optimizer_offload``); bitwise the same results.  ``--plan-memory``."""
    params: bool = False  # the model parameters (megatron DDP's param buffers)
    grads: bool = False  # the gradient buffers (main_grad) and the optimizer's gradients
    optimizer: bool = False  # the optimizer's main parameters (when not the model's) and its state (Adam moments)


@dataclass
class PolicyLossConfig(Checked):
    """The actor's policy loss (rlhf.algorithms.get_policy_loss_fn; docs/algorithms.md)."""
    # a name in rlhf.algorithms.POLICY_LOSS_REGISTRY (vanilla, gspo, sapo, ...; checked by rlhf.config.validate)
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance window [lb, ub] the cut tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that penalty


@dataclass
class PPORoleConfig(Checked):
    """The fields the actor and the critic share (verl's names)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 4  # sequences per forward/backward micro batch
    ppo_epochs: int = 1
    # verl's: every pass visits the rows in a fresh permutation (seeded by the step); false: one epoch in order
    # (a mini batch is whole prompt groups), several epochs each in a permutation
    shuffle: bool = False
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    # dynamic batching (verl's): micro batches of at most ppo_max_token_len_per_gpu tokens instead of
    # ppo_micro_batch_size_per_gpu rows (docs/dynamic_batching.md)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # initial weights from a megatron-core dist checkpoint (parallel.init_checkpoint; the critic's value head starts
    # fresh), config.json and the tokenizer from model.path
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None


@dataclass
class RouterReplayConfig(Checked):
    """MoE routing replay (verl's ``actor.router_replay``; parallel.router_replay): ``disabled``; ``R2``: the update
    replays the routing of the old-log-prob forward; ``R3``: the old-log-prob and update forwards replay the
    engines' routing (needs ``rollout.enable_rollout_routing_replay=true``)."""

    mode: str = "disabled"


@dataclass
class ActorConfig(PPORoleConfig):
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # DAPO decoupled clip
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0  # sapo: soft gate, positive advantages
    tau_neg: float = 1.05  # sapo: ... negative advantages
    # seq-mean-token-sum-norm: the constant the token sums are divided by (Dr.GRPO); null: max_response_length
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLEstimator = KLEstimator.low_var_kl
    log_prob_micro_batch_size_per_gpu: int = 8
    # old / ref log-prob forwards; null: ppo_max_token_len_per_gpu
    log_prob_max_token_len_per_gpu: Optional[int] = None
    ref_param_offload: bool = False  # the reference's parameters off the device outside its log-prob forward
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


@dataclass
class CriticConfig(PPORoleConfig):
    enable: Optional[bool] = None  # None: on when algorithm.adv_estimator == gae
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_max_token_len_per_gpu: int = 32768
    cliprange_value: float = 0.5
    # the value forward's token budget (dynamic batching); null: ppo_max_token_len_per_gpu
    forward_max_token_len_per_gpu: Optional[int] = None
