"""Direct Preference Optimization loss (Rafailov et al. 2023, arXiv:2305.18290)."""

import torch
import torch.nn.functional as F

from rlhf.algorithms._validation import check_1d, check_same_shape

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def compute_dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Preference loss on summed sequence log-probs.

    With h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)):

    * ``"sigmoid"``: -log sigmoid(beta * h)  (DPO, Rafailov et al. 2023, eq. 7);
      with ``label_smoothing = eps`` the conservative variant
      -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
      (cDPO, Mitchell 2023, which assumes labels flipped with probability eps).
    * ``"ipo"``: (h - 1 / (2 beta))^2  (IPO, Azar et al. 2023, arXiv:2310.12036, eq. 17).
    * ``"hinge"``: max(0, 1 - beta * h)  (SLiC, Zhao et al. 2023, arXiv:2305.10425).

    Implicit rewards are r = beta * (log pi - log pi_ref) (DPO eq. 5 up to the
    partition function), returned detached.

    Args:
        policy_chosen_logps: sum over tokens of log pi(y_w | x), nats, shape (batch,).
        policy_rejected_logps: sum of log pi(y_l | x), shape (batch,).
        reference_chosen_logps: sum of log pi_ref(y_w | x), shape (batch,).
        reference_rejected_logps: sum of log pi_ref(y_l | x), shape (batch,).
        beta: KL-regularisation strength (> 0).
        label_smoothing: eps in [0, 0.5), only for ``"sigmoid"``.
        loss_type: one of DPO_LOSS_TYPES.

    Returns:
        loss: scalar, mean over the batch (differentiable w.r.t. the policy log-probs).
        chosen_rewards: (batch,) detached implicit rewards of the chosen responses.
        rejected_rewards: (batch,) detached implicit rewards of the rejected responses.
        metrics: python floats ``dpo/loss``, ``dpo/rewards_chosen``,
            ``dpo/rewards_rejected``, ``dpo/reward_margin`` (batch means) and
            ``dpo/reward_accuracy`` (fraction with chosen reward > rejected reward).

    Raises:
        ValueError: shape mismatch / non-1D inputs, beta <= 0, label smoothing
            outside [0, 0.5) or used with a non-sigmoid loss, unknown loss type.
    """
    check_1d("policy_chosen_logps", policy_chosen_logps)
    check_same_shape(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        reference_chosen_logps=reference_chosen_logps,
        reference_rejected_logps=reference_rejected_logps,
    )
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing is only defined for loss_type='sigmoid', got {loss_type!r}")

    chosen_log_ratio = policy_chosen_logps - reference_chosen_logps
    rejected_log_ratio = policy_rejected_logps - reference_rejected_logps
    h = chosen_log_ratio - rejected_log_ratio

    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {list(DPO_LOSS_TYPES)}")

    loss = losses.mean()
    chosen_rewards = beta * chosen_log_ratio.detach()
    rejected_rewards = beta * rejected_log_ratio.detach()
    metrics = {
        "dpo/loss": loss.item(),
        "dpo/rewards_chosen": chosen_rewards.mean().item(),
        "dpo/rewards_rejected": rejected_rewards.mean().item(),
        "dpo/reward_margin": (chosen_rewards - rejected_rewards).mean().item(),
        "dpo/reward_accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
    }
    return loss, chosen_rewards, rejected_rewards, metrics
