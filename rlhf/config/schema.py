"""Structured schema of the training config (Hydra / OmegaConf).

The YAML tree under `rlhf/config/` (base `ppo_trainer.yaml`, recipes in `recipe/`) is validated
against these dataclasses: a misspelled or removed key fails at start-up (see `rlhf.main`), and
values are type-checked.  Names follow verl's where a verl user would look for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class DataConfig:
    train_files: Any = "embedded://arithmetic"  # path(s) to parquet/jsonl, or embedded://arithmetic
    val_files: Any = "embedded://arithmetic"
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    train_batch_size: int = 8  # prompts per PPO step (each gets rollout.n responses)
    val_batch_size: int = 32
    max_train_samples: Optional[int] = None
    max_val_samples: Optional[int] = 64
    shuffle: bool = True
    seed: int = 1
    embedded_num_train: int = 2000  # size of the generated embedded task
    embedded_num_val: int = 64
    embedded_max_operand: int = 9


@dataclass
class ModelConfig:
    path: str = "tiny://quickstart"  # HF dir, hub name, or tiny://quickstart (built + warmed up locally)
    tokenizer_path: Optional[str] = None
    critic_path: Optional[str] = None  # defaults to `path` (value head freshly initialised)
    make_vocab_size_divisible_by: int = 128
    dtype: str = "float32"  # float32 | bfloat16
    # tiny://quickstart only: supervised warm-up so PPO starts with some signal
    warmup_steps: int = 300
    warmup_lr: float = 3e-3


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # None | full | selective


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False  # True shards Adam state over DP (see README: resume caveat)
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 4  # sequences per forward/backward micro batch
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # DAPO decoupled clip; default clip_ratio
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0  # dual-clip
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    log_prob_micro_batch_size_per_gpu: int = 8


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on when algorithm.adv_estimator == gae
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass
class RolloutValConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1


@dataclass
class RolloutConfig:
    name: str = "sglang"
    mode: str = "colocated"  # colocated | disaggregated
    tensor_model_parallel_size: int = 1
    num_engines: int = 1
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    mem_fraction_static: float = 0.5
    dtype: str = "auto"
    max_restarts: int = 2
    weight_sync_bucket_mb: int = 512
    weight_sync_check: bool = False
    val_kwargs: RolloutValConfig = field(default_factory=RolloutValConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (rlhf/dapo.py): drop prompt groups whose responses all got the same
    `metric`, generate more prompt batches until data.train_batch_size groups are kept."""
    enable: bool = False
    metric: str = "score"  # score (reward) | seq_reward (reward + overlong shaping)
    max_num_gen_batches: int = 10  # generation rounds per step at most (<= 0: no cap)


@dataclass
class DPOConfig:
    """algorithm.name=dpo (rlhf/dpo_trainer.py): offline preference pairs, sigmoid loss."""
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0


@dataclass
class AlgorithmConfig:
    name: str = "ppo"  # ppo (critic-free estimators too) | dpo
    adv_estimator: str = "gae"  # gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment: the last `len` tokens before data.max_response_length cost up
    to `penalty_factor` (rlhf.algorithms.compute_overlong_penalty)."""
    enable: bool = False
    len: Optional[int] = None  # None: data.max_response_length // 4
    penalty_factor: float = 1.0


@dataclass
class RewardSourceConfig:
    """One entry of reward.sources (rlhf/rewards/sources.py); the score is sum(weight x source)."""
    type: str = "rule"  # rule (registry by data_source) | model (HF sequence classifier) | custom (.py)
    weight: float = 1.0
    path: Optional[str] = None  # model: HF dir / hub name; custom: python file
    name: str = "compute_score"  # custom: function name
    placement: str = "ray"  # model: ray (its own Ray worker) | local (in-process on rank 0)
    num_gpus: float = 0.0  # model, placement=ray: GPUs of the worker
    micro_batch_size: int = 16  # model: sequences per forward
    max_length: int = 2048  # model: prompt + response tokens (truncated from the left)


@dataclass
class RewardConfig:
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    timeout_s: Optional[float] = None
    fallback_score: float = 0.0
    # empty: the rule reward of each data_source (or custom_reward_function when set)
    sources: list[RewardSourceConfig] = field(default_factory=list)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class TrainerConfig:
    project_name: str = "rlhf"
    experiment_name: str = "run"
    default_local_dir: str = "outputs/run"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    logger: list = field(default_factory=lambda: ["console", "tensorboard"])
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = 2
    export_hf_at_end: bool = True
    seed: int = 1
    progress_bar: bool = True


@dataclass
class RLHFConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
