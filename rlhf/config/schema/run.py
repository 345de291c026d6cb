"""Schema sections of how a run generates, scores and trains: ``rollout`` (the SGLang engines, with
``rollout.val_kwargs``), ``algorithm`` (estimator, KL control, DAPO's dynamic sampling, DPO), ``reward`` (the weighted
sources of rlhf/rewards/sources.py), ``trainer`` (steps, logging, checkpoints, the job's size) and
``global_profiler`` (verl's: which steps are profiled, rlhf/trainer/profiling.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf.config.choices import (AlgorithmName, Gsm8kMethod, KLControlType, KLEstimator, LoggerBackend, ResumeMode,
                                 RolloutDtype, RolloutMode, RolloutName)
from rlhf.agent.config import MultiTurnSettings
from rlhf.config.schema.rules import Checked, table


@dataclass
class RolloutValConfig(Checked):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1


@dataclass
class MultiTurnConfig(MultiTurnSettings, Checked):
    """verl's ``actor_rollout_ref.rollout.multi_turn``: the fields of rlhf.agent.config.MultiTurnSettings."""

    def rules(self, at: str = "") -> list[str]:
        from rlhf.agent.config import config_problems

        return config_problems(self, at)


@dataclass
class EngineKwargsConfig(Checked):
    """verl's rollout.engine_kwargs: ``sglang`` goes to ``sglang.Engine``; verl's ``vllm`` entries have no effect
    (rlhf/config/verl/keys.yaml)."""
    sglang: dict[str, Any] = field(default_factory=dict)

    def rules(self, at: str = "") -> list[str]:
        """Fields of SGLang's ServerArgs that the rollout does not set itself (rules.yaml ``engine_owned``;
        rlhf.rollout.engine_args.server_args_problems, which imports sglang: only when set)."""
        if not self.sglang:
            return []
        from rlhf.rollout.engine_args import server_args_problems

        return server_args_problems([str(k) for k in self.sglang], table()["engine_owned"])


@dataclass
class RolloutConfig(Checked):
    name: RolloutName = RolloutName.sglang
    mode: RolloutMode = RolloutMode.colocated
    tensor_model_parallel_size: int = 1
    num_engines: int = 1
    # verl's rollout pool (one-step-off recipes): the disaggregated engines' own GPUs, num_engines = nnodes x
    # n_gpus_per_node / TP; trainer.nnodes x trainer.n_gpus_per_node is then the trainer's alone (rollout/placement.py)
    n_gpus_per_node: Optional[int] = None
    nnodes: Optional[int] = None
    n: int = 1  # ppo_trainer.yaml: 4 for GROUP_ESTIMATORS unless a recipe or override sets it
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # also settable as verl's rollout.gpu_memory_utilization
    mem_fraction_static: float = 0.5
    # SGLang's memory saver: colocated engines free weights and KV cache while the trainer computes; null: on with
    # CUDA (the CPU engine has none)
    enable_memory_saver: Optional[bool] = None
    dtype: RolloutDtype = RolloutDtype.auto  # auto: model.dtype (rlhf.rollout.engine_args.resolve_engine_dtype)
    # KV-cache tokens of each engine at most; null: sized to its batch (rlhf.rollout.engine_args.batch_kv_tokens)
    max_total_tokens: Optional[int] = None
    max_restarts: int = 2
    weight_sync_bucket_mb: int = 512
    weight_sync_check: bool = False
    # disaggregated weight sync: the address engines dial to join a stage leader's group.  null: the IP of the
    # leader's outward interface; "iface:<name>" (e.g. iface:ib0): that interface's IPv4; an IP or host name as is
    weight_update_address: Optional[str] = None
    # MoE routing replay R3 (verl's): the engines return each token's routed experts (SGLang's
    # return_routed_experts); the actor replays them with actor.router_replay.mode=R3 and reports
    # moe/routing_agreement either way
    enable_rollout_routing_replay: bool = False
    val_kwargs: RolloutValConfig = field(default_factory=RolloutValConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)


@dataclass
class KLControlConfig(Checked):
    """KL penalty in the reward (algorithm.use_kl_in_reward): kl_coef x KL(actor || reference) per token."""

    type: KLControlType = KLControlType.fixed
    kl_coef: float = 0.001
    # adaptive: target KL in nats per whole response (not per token; Ziegler et al. 2019, arXiv:1909.08593 sec. 2.2)
    target_kl: float = 0.1
    horizon: int = 10000  # adaptive: responses over which the coefficient adapts


@dataclass
class FilterGroupsConfig(Checked):
    """DAPO dynamic sampling (rlhf/dapo.py): drop prompt groups whose responses all got the same `metric`, generate
    more prompt batches until data.train_batch_size groups are kept."""
    enable: bool = False
    # score (reward) | seq_reward (reward + overlong shaping) | acc (the reward's acc extra info, else its score)
    metric: str = "score"
    max_num_gen_batches: int = 10  # generation rounds per step at most (<= 0: no cap)


@dataclass
class DPOConfig:
    """algorithm.name=dpo (rlhf/dpo_trainer.py): offline preference pairs, sigmoid loss."""
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0


@dataclass
class RolloutCorrectionConfig(Checked):
    """verl's algorithm.rollout_correction (rlhf/algorithms/rollout_corr.py): truncated importance sampling and
    rejection sampling from the engine's per-token log-probs, or bypass mode (old_log_probs = the engine's)."""
    rollout_is: Optional[str] = None  # null: off
    rollout_is_threshold: float = 2.0  # upper truncation of the IS weights
    rollout_rs: Optional[str] = None  # null (off) | comma-separated token_k1, seq_sum_k3, ... (rollout_rs.py)
    rollout_rs_threshold: Optional[str] = None  # one per rollout_rs option (comma separated); k1: "lower_upper"
    bypass_mode: bool = False  # true: no old-log-prob forward; the loss trains against the engine's log-probs
    loss_type: str = "ppo_clip"
    rollout_is_batch_normalize: bool = False  # IS weights divided by their batch mean

    def rules(self, at: str = "") -> list[str]:
        if self.rollout_rs is None:
            return []
        from rlhf.algorithms.rollout_corr_config import parse_rollout_rs_thresholds, rs_options

        try:
            parse_rollout_rs_thresholds(rs_options(self.rollout_rs), self.rollout_rs_threshold)
        except (ValueError, TypeError) as e:
            return [f"{at}rollout_rs={self.rollout_rs!r}, {at}rollout_rs_threshold={self.rollout_rs_threshold!r}: {e}"]
        return []


@dataclass
class AlgorithmConfig(Checked):
    name: AlgorithmName = AlgorithmName.ppo
    # a name in rlhf.algorithms' registry (checked by rlhf.config.validate)
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLEstimator = KLEstimator.kl
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # true: responses cut at data.max_response_length (no EOS) are masked out of the policy and value losses
    overlong_filter: bool = False
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment: the last `len` tokens before data.max_response_length cost up to
    `penalty_factor` (rlhf.algorithms.compute_overlong_penalty)."""
    enable: bool = False
    len: Optional[int] = None  # None: data.max_response_length // 4
    penalty_factor: float = 1.0


@dataclass
class RewardSourceConfig(Checked):
    """One entry of reward.sources (rlhf/rewards/sources.py); the score is sum(weight x source)."""
    type: str = "rule"  # rule (registry by data_source) | model (HF sequence classifier) | custom (.py)
    weight: float = 1.0
    # model: HF dir / hub name / tiny://...; custom: python file, or object://reward/<id> (rlhf.config.objects)
    path: Optional[str] = None
    name: str = "compute_score"  # custom: function name
    placement: str = "ray"  # model: ray (its own Ray worker) | local (in-process on rank 0); on the CPU either way
    num_gpus: float = 0.0  # model, placement=ray: GPUs of the worker; > 0 is refused (not placed nor planned)
    micro_batch_size: int = 16  # model: sequences per forward
    max_length: int = 2048  # model: prompt + response tokens (truncated from the left)
    # model, placement=ray: seconds to wait for the worker to load the model (null: no limit)
    start_timeout_s: Optional[float] = 600.0


@dataclass
class Gsm8kRewardConfig(Checked):
    """The GSM8K rule reward (data_source openai/gsm8k)."""
    method: Gsm8kMethod = Gsm8kMethod.strict
    format_score: float = 0.0  # score of a response with an answer in the expected format that is wrong


@dataclass
class RewardFallbackConfig(Checked):
    """What a sample gets from a source that failed on it (rlhf/rewards/fallback.py): rule (else static), static
    (fallback_score + keyword_score x [a keyword in it] - length_penalty x chars past max_chars) or constant."""
    type: str = "rule"
    keywords: list[str] = field(default_factory=list)
    keyword_score: float = 0.0
    length_penalty: float = 0.0  # per character past max_chars
    max_chars: Optional[int] = None  # null: no length penalty


@dataclass
class SandboxFusionConfig(Checked):
    """Code data sources scored by running the response on the test cases in a SandboxFusion service (verl's
    reward_model.sandbox_fusion; rlhf/rewards/sandbox_code.py).  url null: refused; local: rlhf/sandbox/."""
    url: Optional[str] = None
    max_concurrent: int = 64  # requests in flight to the sandbox
    memory_limit_mb: int = 1024  # per run


@dataclass
class RewardConfig(Checked):
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    # a rule/custom source gets timeout_s per sample, a model source per micro batch; slower is a fallback
    timeout_s: Optional[float] = 3.0
    fallback_score: float = 0.0
    fallback: RewardFallbackConfig = field(default_factory=RewardFallbackConfig)
    # true: a sample no source could score is left out of its group's baseline and the loss (reward/num_unscorable)
    exclude_unscorable: bool = True
    # empty: the rule reward of each data_source (or custom_reward_function when set)
    sources: list[RewardSourceConfig] = field(default_factory=list)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    gsm8k: Gsm8kRewardConfig = field(default_factory=Gsm8kRewardConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)


@dataclass
class AlertConfig(Checked):
    """One entry of trainer.alerts (rlhf/trainer/alerts.py): a warning line with the step when `metric` is below
    `below` or above `above` (or not finite)."""
    metric: str = ""  # a step metric, e.g. actor/entropy, actor/kl, critic/score/mean
    below: Optional[float] = None
    above: Optional[float] = None


@dataclass
class OneStepOffPolicyConfig(Checked):
    """One-step off-policy training (verl's experimental/one_step_off_policy; rlhf/trainer/one_step_off.py): the
    engines generate the next batch while the trainer trains on this one (verl: one_step_off_ppo_trainer)."""
    enable: bool = False
    # 1: batch k+1 is generated during step k's update, from the weights before it; 0: after the weight sync
    staleness: int = 1


@dataclass
class AsyncTrainingConfig(Checked):
    """Fully asynchronous training (verl's experimental/fully_async_policy ``async_training``; rlhf/trainer/
    fully_async.py): a rollouter streams prompt groups into a bounded queue while the trainer consumes
    ``require_batches x actor.ppo_mini_batch_size`` of them per step.  verl selects it by its entry point / config name
    (fully_async_ppo_trainer, which turns ``enable`` on here); on GPU give the engines their own GPUs."""
    enable: bool = False
    # at most (1 + this) x trigger_parameter_sync_step x require_batches x ppo_mini_batch_size groups are generated
    # between two weight syncs, minus those left over from the last one (0: on-policy)
    staleness_threshold: float = 0.1
    trigger_parameter_sync_step: int = 4  # trainer steps between two weight syncs into the engines
    require_batches: int = 1  # ppo mini batches per trainer step
    # a sync pauses the requests in flight at their next chunk of partial_rollout_chunk_tokens tokens; they continue
    # on the new weights (each token keeps its log-prob and weight version); false: the sync waits for them
    partial_rollout: bool = True
    partial_rollout_chunk_tokens: Optional[int] = None
    # true: old_log_probs are the engine's (no trainer forward) unless compute_prox_log_prob
    use_rollout_log_probs: bool = True
    compute_prox_log_prob: bool = False  # true: old_log_probs from the trainer (rollout IS against the engine's)


@dataclass
class TrainerConfig(Checked):
    project_name: str = "rlhf"  # wandb project / mlflow experiment
    experiment_name: str = "run"  # wandb / mlflow run name
    # checkpoints, TensorBoard, HF export, .hydra/ (hydra.run.dir sets it)
    default_local_dir: str = "outputs/run"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    # console, tensorboard, wandb, mlflow: a list, or one name
    logger: list[LoggerBackend] = field(default_factory=lambda: [LoggerBackend.console, LoggerBackend.tensorboard])
    log_freq: int = 1  # write the step metrics to the loggers every this many steps
    log_val_generations: int = 0  # validation samples (prompt, response, score) logged as a table
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    critic_warmup: int = 0  # first steps that train only the critic (the actor is not updated)
    # auto: the latest checkpoint under default_local_dir, or resume_from_path when given; resume_path: resume_from_path
    resume_mode: ResumeMode = ResumeMode.auto
    # a checkpoint (<run>/checkpoints/global_step_N), or a checkpoints directory / run directory (its latest)
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = 2
    # true: checkpoints hold only what resuming needs (no frozen weights); either resumes bitwise
    slim_checkpoint: bool = True
    export_hf_at_end: bool = True
    seed: int = 1
    progress_bar: bool = True
    # warnings when a step metric crosses a threshold (rlhf/trainer/alerts.py): [{metric: actor/kl, above: 1.0}]
    alerts: list[AlertConfig] = field(default_factory=list)
    # the job's size (verl's keys): null = as launched; when set, checked and used by `rlhf launch`
    n_gpus_per_node: Optional[int] = None
    nnodes: Optional[int] = None
    one_step_off_policy: OneStepOffPolicyConfig = field(default_factory=OneStepOffPolicyConfig)


@dataclass
class GlobalProfilerConfig(Checked):
    """verl's ``global_profiler``: torch.profiler traces (or an nsys capture range) of the listed training steps
    (rlhf/trainer/profiling.py)."""
    tool: Optional[str] = None
    steps: Optional[list[int]] = None  # training steps to profile, e.g. [1, 5, 10]; null: none
    save_path: Optional[str] = None  # traces' directory; null: <trainer.default_local_dir>/profile
    profile_continuous_steps: bool = False

    def rules(self, at: str = "") -> list[str]:
        bad = [s for s in (self.steps or []) if s is None or s < 1]
        return [f"{at}steps={list(self.steps)} holds {bad}: steps count from 1, e.g. {at}steps=[1,5,10]."] if bad \
            else []
