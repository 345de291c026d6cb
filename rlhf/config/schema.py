"""Structured schema of the training config (Hydra / OmegaConf): every key, its type and its default.

The YAML tree under `rlhf/config/` (base `ppo_trainer.yaml`, `algorithm/` presets, `recipe/` files) is
composed onto these dataclasses in struct mode, so OmegaConf itself rejects an unknown key, a value of
the wrong type and a value outside an Enum's members (``rollout.mode=hybrid``).  Ranges and rules
within one section are each dataclass's ``problems(at)`` method (run by ``__post_init__`` when the
dataclass is built, and on the composed config by :func:`field_problems`, which reports them all at
once); rules that span sections are in :mod:`rlhf.config.validate`.  Names follow verl's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rlhf.config.choices import (AlgorithmName, KLControlType, KLEstimator, LoggerBackend, LossAggMode, ModelDtype,
                                 Recompute, ResumeMode, RolloutDtype, RolloutMode, RolloutName)
from rlhf.config.errors import ConfigValidationError
from rlhf.mcore.optim_config import OptimConfig


# --------------------------------------------------------------------------- single-field rules


class Checked:
    """Base of the schema's dataclasses: ``problems(at)`` lists the out-of-range values of this section
    (keys prefixed with ``at``), ``__post_init__`` raises them.  ``problems`` only reads attributes, so
    :func:`field_problems` can run it on an OmegaConf node of the dataclass's type."""

    def __post_init__(self) -> None:
        problems = type(self).problems(self)
        if problems:
            raise ConfigValidationError(problems)

    def problems(self, at: str = "") -> list[str]:
        return []


def _rule(obj: Any, at: str, keys: str, ok: Callable[[Any], bool], must: str) -> list[str]:
    """``"{at}{key}={value!r} {must}."`` for each space-separated key in ``keys`` whose value fails ``ok``."""
    out = []
    for k in keys.split():
        v = getattr(obj, k)
        if v is None or not ok(v):
            out.append(f"{at}{k}={v!r} {must}.")
    return out


def _ge(obj: Any, at: str, keys: str, lo: float, fix: str = "") -> list[str]:
    return _rule(obj, at, keys, lambda v: v >= lo, f"must be >= {lo}" + (f"; {fix}" if fix else ""))


def _ge_or_null(obj: Any, at: str, keys: str, fix: str) -> list[str]:
    return [f"{at}{k}={getattr(obj, k)!r} must be >= 1 (or null); {fix}." for k in keys.split()
            if getattr(obj, k) is not None and getattr(obj, k) < 1]


def _steps_or_never(obj: Any, at: str, keys: str) -> list[str]:
    return _rule(obj, at, keys, lambda v: v == -1 or v >= 1, "must be -1 (never) or a number of steps >= 1")


def _sampling(obj: Any, at: str) -> list[str]:
    return (_ge(obj, at, "temperature", 0, "0 is greedy")
            + _rule(obj, at, "top_p", lambda v: 0 < v <= 1, "must be in (0, 1] (1.0 disables nucleus sampling)")
            + _rule(obj, at, "top_k", lambda v: v == -1 or v >= 1, "must be -1 (disabled) or >= 1")
            + _ge(obj, at, "n", 1))


# --------------------------------------------------------------------------- sections


@dataclass
class DataConfig(Checked):
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

    def problems(self, at: str = "") -> list[str]:
        out = _ge(self, at, "max_prompt_length max_response_length train_batch_size val_batch_size", 1)
        out += _ge_or_null(self, at, "max_train_samples max_val_samples", "use null for all samples")
        for k in ("train_files", "val_files"):
            v = getattr(self, k)
            if v is None or v == "" or (not isinstance(v, str) and hasattr(v, "__len__") and len(v) == 0):
                out.append(f"{at}{k}={v!r} is empty; give a .jsonl/.parquet path (or a list of them) or "
                           f"embedded://arithmetic.")
        return out


@dataclass
class ModelConfig(Checked):
    path: str = "tiny://quickstart"  # HF dir, hub name, or tiny://quickstart (built + warmed up locally)
    tokenizer_path: Optional[str] = None
    critic_path: Optional[str] = None  # defaults to `path` (value head freshly initialised)
    make_vocab_size_divisible_by: int = 128
    dtype: ModelDtype = ModelDtype.float32
    # tiny://quickstart only: supervised warm-up so PPO starts with some signal
    warmup_steps: int = 300
    warmup_lr: float = 3e-3

    def problems(self, at: str = "") -> list[str]:
        return [] if self.path else [f"{at}path is empty; give an HF directory, a hub name or tiny://quickstart."]


@dataclass
class ParallelConfig(Checked):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    recompute: Optional[Recompute] = None

    def problems(self, at: str = "") -> list[str]:
        out = _ge(self, at, "tensor_model_parallel_size pipeline_model_parallel_size", 1)
        vpp, pp = self.virtual_pipeline_model_parallel_size, self.pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or (pp or 1) < 2):
            out.append(f"{at}virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
                       f"(got {pp}) and a value >= 1; set it to null.")
        return out


def _ppo_role(obj: Any, at: str) -> list[str]:
    return _ge(obj, at, "ppo_epochs ppo_micro_batch_size_per_gpu ppo_mini_batch_size", 1)


@dataclass
class ActorConfig(Checked):
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 4  # sequences per forward/backward micro batch
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # DAPO decoupled clip; default clip_ratio
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0  # dual-clip
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLEstimator = KLEstimator.low_var_kl
    log_prob_micro_batch_size_per_gpu: int = 8

    def problems(self, at: str = "") -> list[str]:
        return (_ppo_role(self, at) + _ge(self, at, "log_prob_micro_batch_size_per_gpu", 1)
                + _rule(self, at, "clip_ratio", lambda v: v > 0, "must be > 0 (PPO uses 0.2)")
                + [f"{at}{k}={getattr(self, k)!r} must be > 0, or null to use {at}clip_ratio."
                   for k in ("clip_ratio_low", "clip_ratio_high")
                   if getattr(self, k) is not None and getattr(self, k) <= 0]
                + _rule(self, at, "clip_ratio_c", lambda v: v > 1, "must be > 1 (dual-clip lower bound; verl uses 3.0)")
                + _ge(self, at, "kl_loss_coef", 0))


@dataclass
class CriticConfig(Checked):
    enable: Optional[bool] = None  # None: on when algorithm.adv_estimator == gae
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]

    def problems(self, at: str = "") -> list[str]:
        return _ppo_role(self, at) + _rule(self, at, "cliprange_value", lambda v: v > 0, "must be > 0 (verl uses 0.5)")


@dataclass
class RolloutValConfig(Checked):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1

    def problems(self, at: str = "") -> list[str]:
        return _sampling(self, at)


@dataclass
class RolloutConfig(Checked):
    name: RolloutName = RolloutName.sglang
    mode: RolloutMode = RolloutMode.colocated
    tensor_model_parallel_size: int = 1
    num_engines: int = 1
    n: int = 1  # ppo_trainer.yaml: 4 for GROUP_ESTIMATORS unless a recipe or override sets it
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    mem_fraction_static: float = 0.5
    dtype: RolloutDtype = RolloutDtype.auto
    max_restarts: int = 2
    weight_sync_bucket_mb: int = 512
    weight_sync_check: bool = False
    val_kwargs: RolloutValConfig = field(default_factory=RolloutValConfig)

    def problems(self, at: str = "") -> list[str]:
        return (_ge(self, at, "tensor_model_parallel_size num_engines weight_sync_bucket_mb", 1)
                + _ge(self, at, "max_restarts", 0) + _sampling(self, at)
                + _rule(self, at, "mem_fraction_static", lambda v: 0 < v < 1,
                        "must be in (0, 1) (fraction of device memory for SGLang's weights + KV cache; ~0.5 "
                        "when colocated with the trainer)"))


@dataclass
class KLControlConfig(Checked):
    type: KLControlType = KLControlType.fixed
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000

    def problems(self, at: str = "") -> list[str]:
        out = _ge(self, at, "kl_coef", 0)
        if self.type == KLControlType.adaptive:
            out += _rule(self, at, "target_kl horizon", lambda v: v > 0, f"must be > 0 for {at}type=adaptive")
        return out


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
class AlgorithmConfig(Checked):
    name: AlgorithmName = AlgorithmName.ppo
    adv_estimator: str = "gae"  # a name in rlhf.algorithms' registry (checked by rlhf.config.validate)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLEstimator = KLEstimator.kl
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def problems(self, at: str = "") -> list[str]:
        return _rule(self, at, "gamma lam", lambda v: 0 <= v <= 1, "must be in [0, 1] (1.0 for outcome rewards)")


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
class RewardConfig(Checked):
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    timeout_s: Optional[float] = None
    fallback_score: float = 0.0
    # empty: the rule reward of each data_source (or custom_reward_function when set)
    sources: list[RewardSourceConfig] = field(default_factory=list)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def problems(self, at: str = "") -> list[str]:
        to = self.timeout_s
        return [f"{at}timeout_s={to!r} must be > 0, or null for no timeout."] if to is not None and to <= 0 else []


@dataclass
class TrainerConfig(Checked):
    project_name: str = "rlhf"
    experiment_name: str = "run"
    default_local_dir: str = "outputs/run"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    logger: list[LoggerBackend] = field(default_factory=lambda: [LoggerBackend.console, LoggerBackend.tensorboard])
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    resume_mode: ResumeMode = ResumeMode.auto
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = 2
    export_hf_at_end: bool = True
    seed: int = 1
    progress_bar: bool = True

    def problems(self, at: str = "") -> list[str]:
        out = (_ge(self, at, "total_epochs", 1) + _steps_or_never(self, at, "save_freq test_freq")
               + _ge_or_null(self, at, "total_training_steps", f"null trains for {at}total_epochs")
               + _ge_or_null(self, at, "max_ckpt_to_keep", "null keeps all"))
        mode, rfp = self.resume_mode, self.resume_from_path
        if mode == ResumeMode.resume_path and not rfp:
            out.append(f"{at}resume_mode=resume_path needs {at}resume_from_path=<checkpoint dir>.")
        if rfp and mode in (ResumeMode.auto, ResumeMode.disable):
            out.append(f"{at}resume_from_path={rfp!r} is ignored with {at}resume_mode={mode}; "
                       f"set {at}resume_mode=resume_path (or drop resume_from_path).")
        if not self.default_local_dir:
            out.append(f"{at}default_local_dir is empty; give the output directory for checkpoints and logs.")
        return out


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


# --------------------------------------------------------------------------- all at once


def field_problems(cfg: Any) -> list[str]:
    """Every single-field problem of a composed config (a DictConfig typed by :class:`RLHFConfig`): the
    ``problems`` of each section, run on the config's nodes, in schema order, keys in full."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    out: list[str] = []

    def walk(node: Any, at: str) -> None:
        check = getattr(OmegaConf.get_type(node), "problems", None)
        if check is not None:
            out.extend(check(node, at))
        for k in node.keys():
            child = node[k]
            if isinstance(child, DictConfig):
                walk(child, f"{at}{k}.")
            elif isinstance(child, ListConfig):
                for i, item in enumerate(child):
                    if isinstance(item, DictConfig):
                        walk(item, f"{at}{k}[{i}].")

    walk(cfg, "")
    return out
