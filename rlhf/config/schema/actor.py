"""Schema sections ``actor`` (with ``actor.policy_loss``) and ``critic``.  Names and defaults are verl's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf.config.choices import KLEstimator, LossAggMode
from rlhf.config.schema.rules import Checked, ge, gt, gt_or_null, rule
from parallel.optim_config import OptimConfig

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


def _ppo_role(obj: Any, at: str) -> list[str]:
    out = ge(obj, at, "ppo_epochs ppo_micro_batch_size_per_gpu ppo_mini_batch_size", 1)
    if obj.use_dist_checkpointing and not obj.dist_checkpointing_path:
        out.append(f"{at}use_dist_checkpointing=true needs {at}dist_checkpointing_path: a megatron-core dist "
                   f"checkpoint directory (scripts/convert_checkpoint.py hf-to-mcore writes one).")
    return out


@dataclass
class PolicyLossConfig(Checked):
    """The actor's policy loss (rlhf.algorithms.get_policy_loss_fn; docs/algorithms.md)."""

    # a name in rlhf.algorithms.POLICY_LOSS_REGISTRY: vanilla (PPO clip), gspo, sapo, gpg, clip_cov, kl_cov,
    # geo_mean (GMPO), cispo (checked by rlhf.config.validate)
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance window [lb, ub] the cut tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that penalty

    def problems(self, at: str = "") -> list[str]:
        out = rule(self, at, "clip_cov_ratio kl_cov_ratio", lambda v: 0 < v <= 1,
                   "must be in (0, 1] (a fraction of the response tokens; verl uses 0.0002)")
        out += ge(self, at, "ppo_kl_coef", 0)
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        if lb is not None and ub is not None and lb > ub:
            out.append(f"{at}clip_cov_lb={lb} is above {at}clip_cov_ub={ub}; the window is [lb, ub] (verl: 1.0, 5.0).")
        return out


@dataclass
class ActorConfig(Checked):
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 4  # sequences per forward/backward micro batch
    ppo_epochs: int = 1
    # verl's: every pass over the batch visits its rows in a fresh permutation (seeded by the step), so a mini batch
    # mixes the responses of many prompts; false: one epoch in order (a mini batch is whole prompt groups), several
    # epochs each in a permutation
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # DAPO decoupled clip; default clip_ratio
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0  # dual-clip
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0  # sapo: temperature of the soft gate for positive advantages
    tau_neg: float = 1.05  # sapo: ... for negative advantages
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    # loss_agg_mode=seq-mean-token-sum-norm: the constant C the token sums are divided by (Dr.GRPO); null: the
    # response length data.max_response_length
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLEstimator = KLEstimator.low_var_kl
    log_prob_micro_batch_size_per_gpu: int = 8
    # dynamic batching (verl's): micro batches of at most ppo_max_token_len_per_gpu tokens (rows x the longest
    # row) instead of ppo_micro_batch_size_per_gpu rows, rows of similar length together, each micro batch cut
    # to its longest row.  megatron's packed THD path needs Transformer Engine; without it (CPU, local spec) this
    # compacted-rows fallback runs and is counted in perf/packing_fallback_micro_batches (docs/dynamic_batching.md)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_max_token_len_per_gpu: Optional[int] = None  # old / ref log-prob forwards; null: ppo_max_token_len_per_gpu
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    ref_param_offload: bool = False  # the reference's parameters off the device outside its log-prob forward
    # initial weights of the actor and the reference from a megatron-core dist checkpoint (any TP/PP layout;
    # parallel.init_checkpoint) instead of model.path's safetensors; config.json and the tokenizer still come
    # from model.path (verl's actor.megatron.use_dist_checkpointing / dist_checkpointing_path)
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None

    def problems(self, at: str = "") -> list[str]:
        return (_ppo_role(self, at) + ge(self, at, "log_prob_micro_batch_size_per_gpu ppo_max_token_len_per_gpu", 1)
                + gt_or_null(self, at, "log_prob_max_token_len_per_gpu", "null uses ppo_max_token_len_per_gpu")
                + rule(self, at, "clip_ratio", lambda v: v > 0, "must be > 0 (PPO uses 0.2)")
                + [f"{at}{k}={getattr(self, k)!r} must be > 0, or null to use {at}clip_ratio."
                   for k in ("clip_ratio_low", "clip_ratio_high")
                   if getattr(self, k) is not None and getattr(self, k) <= 0]
                + rule(self, at, "clip_ratio_c", lambda v: v > 1, "must be > 1 (dual-clip lower bound; verl uses 3.0)")
                + gt(self, at, "tau_pos tau_neg", 0, "sapo's gate temperatures (verl: 1.0, 1.05)")
                + gt_or_null(self, at, "loss_scale_factor", "null uses the response length")
                + ge(self, at, "kl_loss_coef", 0))


@dataclass
class CriticConfig(Checked):
    enable: Optional[bool] = None  # None: on when algorithm.adv_estimator == gae
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_epochs: int = 1
    shuffle: bool = False  # as actor.shuffle
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]
    # dynamic batching, as actor.use_dynamic_bsz: token budgets of the value update and of the no-grad value forward
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: Optional[int] = None  # null: ppo_max_token_len_per_gpu
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # the critic's initial weights from a megatron-core dist checkpoint (its LM head is not used: the value head
    # starts fresh); config.json from model.critic_path (default model.path)
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None

    def problems(self, at: str = "") -> list[str]:
        return (_ppo_role(self, at) + rule(self, at, "cliprange_value", lambda v: v > 0, "must be > 0 (verl uses 0.5)")
                + ge(self, at, "ppo_max_token_len_per_gpu", 1)
                + gt_or_null(self, at, "forward_max_token_len_per_gpu", "null uses ppo_max_token_len_per_gpu"))
