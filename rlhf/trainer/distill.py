"""On-policy distillation in the PPO step (``distill.enable``; rlhf.algorithms.distill, docs/algorithms.md).

    generate (student) -> reward -> old log-probs (student) -> teacher log-probs -> advantages of the task reward
    -> A_hat = A - distill.kl_coef x (old_log_probs - teacher_log_probs) on response tokens -> actor update

The teacher (rlhf.workers.teacher) is resolved and its tokenizer checked before any model is built, built after the
actor and reference, and scores the batch after the reference; the ``distill/`` metrics are the batch's."""
from __future__ import annotations

from rlhf.algorithms.distill import apply_opd_to_advantages, opd_metrics, opd_reverse_kl

__all__ = ["apply_distillation"]


def apply_distillation(batch: dict, dcfg, train: bool = True) -> dict:
    """Replace batch["advantages"] [N, R] by ``A - kl_coef x d`` (``distill.task_reward=false``: ``-kl_coef x d``;
    ``distill.center``: d less its batch mean),
    d = batch["old_log_probs"] - batch["teacher_log_probs"] on batch["response_mask"]; keeps d as
    batch["opd_reverse_kl"].  With `train` false (a step that will not update the actor) only the metrics are
    computed.  Returns the ``distill/`` metrics (rlhf.algorithms.distill.opd_metrics)."""
    mask = batch["response_mask"]
    d = opd_reverse_kl(batch["old_log_probs"], batch["teacher_log_probs"], mask)
    batch["opd_reverse_kl"] = d
    if train:
        batch["advantages"] = apply_opd_to_advantages(batch["advantages"], d, mask, dcfg.kl_coef,
                                                      task_reward=dcfg.task_reward, center=dcfg.center)
    return opd_metrics(batch["old_log_probs"], batch["teacher_log_probs"], d, mask, dcfg.kl_coef)
