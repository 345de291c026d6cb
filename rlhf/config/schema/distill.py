"""Schema section ``distill``: on-policy distillation (rlhf.algorithms.distill, docs/algorithms.md).  verl's main
branch has no such keys (its PR #4897's ``actor_rollout_ref.distillation.*`` is refused with a pointer here:
rlhf/config/verl/keys.yaml), so the names are slime's OPD arguments: --use-opd = distill.enable, --opd-kl-coef =
distill.kl_coef, --opd-teacher-load = distill.teacher.path (an HF checkpoint, hub name or tiny://); --opd-type megatron
is the only kind here (the teacher is a megatron GPTModel on the trainer ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlhf.config.schema.rules import Checked


@dataclass
class TeacherConfig(Checked):
    """The teacher: a frozen megatron GPTModel from an HF checkpoint (may be larger than the student), sharded like
    the trainer or on a grid of its own (over the same ranks); it must share the student's tokenizer (checked at --cfg
    from the files, and again at start before any model is built)."""
    path: Optional[str] = None  # HF directory, hub name or tiny://quickstart (slime: --opd-teacher-load)
    # sequences per no-grad forward; null: actor.log_prob_micro_batch_size_per_gpu
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    param_offload: bool = False  # the teacher's parameters off the device outside its forward (like the reference's)
    # the teacher's own megatron grid over the trainer's ranks (verl's teacher: inference.tensor_model_parallel_size;
    # slime's megatron teacher shares the actor's); null: the trainer's parallel.* size.  A second grid has expert
    # and context parallel size 1 and no virtual pipeline (parallel.layouts)
    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None


@dataclass
class DistillConfig(Checked):
    """On-policy distillation: A_hat_t = A_t - kl_coef x (log pi_student(a_t) - log pi_teacher(a_t)) per response
    token of the student's rollouts (slime's apply_opd_kl_to_advantages); ``distill/`` metrics."""
    enable: bool = False  # slime: --use-opd
    kl_coef: float = 1.0  # slime: --opd-kl-coef (default 1.0)
    # true: the task reward's advantages plus the distillation term; false: pure distillation (the reward is logged)
    task_reward: bool = True
    # subtract the batch's mean reverse KL from each token's (a constant baseline: unbiased, lower variance)
    center: bool = False
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
