"""On-policy distillation (OPD): a teacher scores every token the student sampled.

The student (the actor) generates; a fixed teacher computes log pi_T(a_t | h_t) of the student's own sampled tokens.
The per-token signal is the sampled (k1) estimate of the reverse KL, KL(student || teacher):

    d_t = log pi_theta(a_t | h_t) - log pi_T(a_t | h_t),      a_t ~ pi_theta(. | h_t)

(Thinking Machines Lab, "On-Policy Distillation", 2025, https://thinkingmachines.ai/blog/on-policy-distillation/;
tinker-cookbook ``distillation/train_on_policy.py``).  It enters the policy loss as a per-token negative advantage,
orthogonal to the advantage estimator, as slime does (``slime/backends/megatron_utils/loss.py``
``apply_opd_kl_to_advantages``):

    A_hat_t = A_t - kl_coef * d_t

with A_t the configured estimator's advantage of the task reward (0 for pure distillation).  No discount: each token
gets its own d_t (tinker's default ``kl_discount_factor=0``).  An individual d_t may be negative; its expectation
under the student is the KL, >= 0.
"""
from __future__ import annotations

import torch

from rlhf.algorithms._validation import check_same_shape
from rlhf.algorithms.masked_ops import masked_mean

__all__ = ["opd_reverse_kl", "apply_opd_to_advantages", "opd_metrics"]


def opd_reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(student || teacher) on the student's sampled tokens.

    Args:
        student_log_probs: log pi_theta(a_t | h_t), nats, [N, R] (the actor's ``old_log_probs``).
        teacher_log_probs: log pi_T(a_t | h_t) of the same tokens, nats, [N, R].
        response_mask: [N, R], 1 on response tokens.

    Returns:
        [N, R] float: ``student - teacher`` on response tokens, 0 elsewhere (padding never leaks: masked with
        ``torch.where``).

    Raises:
        ValueError: shapes differ.
    """
    check_same_shape(student_log_probs=student_log_probs, teacher_log_probs=teacher_log_probs,
                     response_mask=response_mask)
    d = student_log_probs.float() - teacher_log_probs.float()
    return torch.where(response_mask != 0, d, torch.zeros_like(d))


def apply_opd_to_advantages(advantages: torch.Tensor, reverse_kl: torch.Tensor, response_mask: torch.Tensor,
                            kl_coef: float, task_reward: bool = True, center: bool = False) -> torch.Tensor:
    """``A_hat = A - kl_coef * d`` on response tokens (slime's ``apply_opd_kl_to_advantages``); with `center`,
    ``A_hat = A - kl_coef * (d - mean d)``, the mean over the batch's response tokens.

    Args:
        advantages: [N, R] the estimator's advantages of the task reward.
        reverse_kl: [N, R] from :func:`opd_reverse_kl`.
        response_mask: [N, R].
        kl_coef: lambda_opd >= 0 (slime's ``--opd-kl-coef``; ``distill.kl_coef``).
        task_reward: false: pure distillation, A is taken as 0 (the task reward is only logged).
        center: subtract the batch's mean d (a constant baseline: E[grad log pi] = 0 keeps the gradient of the
            KL unbiased, and the policy gradient no longer pushes every sampled token down at once, which from a
            far-off student, where d is large on every token, lets mass drift to unsampled tokens).

    Returns:
        [N, R] the new advantages, 0 outside the response.

    Raises:
        ValueError: shapes differ or ``kl_coef`` < 0.
    """
    check_same_shape(advantages=advantages, reverse_kl=reverse_kl, response_mask=response_mask)
    if kl_coef < 0:
        raise ValueError(f"distill.kl_coef={kl_coef} must be >= 0 (the student is pushed towards the teacher)")
    base = advantages if task_reward else torch.zeros_like(advantages)
    d = reverse_kl.to(advantages.dtype)
    if center:
        d = d - masked_mean(d, response_mask)
    out = base - kl_coef * d
    return torch.where(response_mask != 0, out, torch.zeros_like(out))


def opd_metrics(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, reverse_kl: torch.Tensor,
                response_mask: torch.Tensor, kl_coef: float) -> dict:
    """The ``distill/`` metrics of a batch (means over its response tokens, all ranks' rows):

    * ``distill/reverse_kl``: mean d_t (the k1 estimate of KL(student || teacher) per token, nats);
      ``distill/reverse_kl_max`` / ``_min``: over tokens;
    * ``distill/reverse_kl_seq``: mean over responses of sum_t d_t (the sequence-level KL estimate);
    * ``distill/teacher_logprob``, ``distill/student_logprob``: mean log-probs of the sampled tokens;
    * ``distill/kl_coef``.

    Shapes: [N, R] each.  Returns plain floats."""
    mask = response_mask != 0
    any_token = bool(mask.any())
    pick = reverse_kl[mask] if any_token else reverse_kl.new_zeros(1)
    return {
        "distill/reverse_kl": float(masked_mean(reverse_kl, response_mask)),
        "distill/reverse_kl_max": float(pick.max()),
        "distill/reverse_kl_min": float(pick.min()),
        "distill/reverse_kl_seq": float((reverse_kl * mask).sum(-1).mean()) if reverse_kl.numel() else 0.0,
        "distill/teacher_logprob": float(masked_mean(teacher_log_probs.float(), response_mask)),
        "distill/student_logprob": float(masked_mean(student_log_probs.float(), response_mask)),
        "distill/kl_coef": float(kl_coef),
    }
