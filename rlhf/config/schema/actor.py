"""Schema sections ``actor`` (with ``actor.policy_loss``) and ``critic``.  Names and defaults are verl's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from parallel.optim_config import OptimConfig
from rlhf.config.choices import KLEstimator, LossAggMode
from rlhf.config.schema.rules import Checked, check, ge, gt, gt0_or_null

__all__ = ["PolicyLossConfig", "OffloadConfig", "ActorConfig", "CriticConfig"]


@dataclass
class OffloadConfig(Checked):
    """What of a role leaves its device while other phases run (generation, the other roles' passes) and comes
    back before the role uses it (parallel.offload; verl's ``<role>.megatron.param_offload`` / ``grad_offload``
    / ``optimizer_offload``).  Results are bitwise those without offload; each switch costs two host<->device
    copies of its part per use.  ``--plan-memory`` shows what each saves."""

    params: bool = False  # the model parameters (megatron DDP's param buffers)
    grads: bool = False  # the gradient buffers (main_grad) and the optimizer's gradients
    optimizer: bool = False  # the optimizer's main parameters (when not the model's) and its state (Adam moments)


class _PPORole(Checked):
    def rules(self, at: str = "") -> list[str]:
        return [f"{at}use_dist_checkpointing=true needs {at}dist_checkpointing_path: a megatron-core dist checkpoint "
                f"directory (scripts/convert_checkpoint.py hf-to-mcore writes one)."] if \
            self.use_dist_checkpointing and not self.dist_checkpointing_path else []


_FRACTION = (lambda v: 0 < v <= 1, "must be in (0, 1] (a fraction of the response tokens; verl uses 0.0002)")


@dataclass
class PolicyLossConfig(Checked):
    """The actor's policy loss (rlhf.algorithms.get_policy_loss_fn; docs/algorithms.md)."""

    # a name in rlhf.algorithms.POLICY_LOSS_REGISTRY: vanilla (PPO clip), gspo, sapo, gpg, clip_cov, kl_cov,
    # geo_mean (GMPO), cispo (checked by rlhf.config.validate)
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = check(0.0002, *_FRACTION)  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance window [lb, ub] the cut tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = check(0.0002, *_FRACTION)  # kl_cov: fraction of tokens that get the KL penalty
    ppo_kl_coef: float = ge(0, 0.1)  # kl_cov: coefficient of that penalty

    def rules(self, at: str = "") -> list[str]:
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        return [f"{at}clip_cov_lb={lb} is above {at}clip_cov_ub={ub}; the window is [lb, ub] (verl: 1.0, 5.0)."] if \
            lb is not None and ub is not None and lb > ub else []


_CLIP = "must be > 0, or null to use {at}clip_ratio"


@dataclass
class ActorConfig(_PPORole):
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = ge(1, 8)  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = ge(1, 4)  # sequences per forward/backward micro batch
    ppo_epochs: int = ge(1, 1)
    # verl's: every pass over the batch visits its rows in a fresh permutation (seeded by the step), so a mini batch
    # mixes the responses of many prompts; false: one epoch in order (a mini batch is whole prompt groups), several
    # epochs each in a permutation
    shuffle: bool = False
    clip_ratio: float = check(0.2, lambda v: v > 0, "must be > 0 (PPO uses 0.2)")
    clip_ratio_low: Optional[float] = check(None, lambda v: v > 0, _CLIP, null=True)  # DAPO decoupled clip
    clip_ratio_high: Optional[float] = check(None, lambda v: v > 0, _CLIP, null=True)
    clip_ratio_c: float = check(3.0, lambda v: v > 1, "must be > 1 (dual-clip lower bound; verl uses 3.0)")
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = gt(0, 1.0, "sapo's gate temperatures (verl: 1.0, 1.05)")  # sapo: soft gate, positive advantages
    tau_neg: float = gt(0, 1.05, "sapo's gate temperatures (verl: 1.0, 1.05)")  # sapo: ... negative advantages
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    # loss_agg_mode=seq-mean-token-sum-norm: the constant C the token sums are divided by (Dr.GRPO); null: the
    # response length data.max_response_length
    loss_scale_factor: Optional[float] = gt0_or_null(None, "null uses the response length")
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = ge(0, 0.001)
    kl_loss_type: KLEstimator = KLEstimator.low_var_kl
    log_prob_micro_batch_size_per_gpu: int = ge(1, 8)
    # dynamic batching (verl's): micro batches of at most ppo_max_token_len_per_gpu tokens (rows x the longest
    # row) instead of ppo_micro_batch_size_per_gpu rows, rows of similar length together, each micro batch cut
    # to its longest row.  megatron's packed THD path needs Transformer Engine; without it (CPU, local spec) this
    # compacted-rows fallback runs and is counted in perf/packing_fallback_micro_batches (docs/dynamic_batching.md)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = ge(1, 16384)
    # old / ref log-prob forwards; null: ppo_max_token_len_per_gpu
    log_prob_max_token_len_per_gpu: Optional[int] = gt0_or_null(None, "null uses ppo_max_token_len_per_gpu")
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    ref_param_offload: bool = False  # the reference's parameters off the device outside its log-prob forward
    # initial weights of the actor and the reference from a megatron-core dist checkpoint (any TP/PP layout;
    # parallel.init_checkpoint) instead of model.path's safetensors; config.json and the tokenizer still come
    # from model.path (verl's actor.megatron.use_dist_checkpointing / dist_checkpointing_path)
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None


@dataclass
class CriticConfig(_PPORole):
    enable: Optional[bool] = None  # None: on when algorithm.adv_estimator == gae
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = ge(1, 8)
    ppo_micro_batch_size_per_gpu: int = ge(1, 4)
    ppo_epochs: int = ge(1, 1)
    shuffle: bool = False  # as actor.shuffle
    cliprange_value: float = check(0.5, lambda v: v > 0, "must be > 0 (verl uses 0.5)")
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    # dynamic batching, as actor.use_dynamic_bsz: token budgets of the value update and of the no-grad value forward
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = ge(1, 32768)
    forward_max_token_len_per_gpu: Optional[int] = gt0_or_null(None, "null uses ppo_max_token_len_per_gpu")
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # the critic's initial weights from a megatron-core dist checkpoint (its LM head is not used: the value head
    # starts fresh); config.json from model.critic_path (default model.path)
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None
