"""Direct Preference Optimization loss (Rafailov et al. 2023, arXiv:2305.18290) and its IPO / SLiC variants."""

from typing import Optional, Union

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
    chosen_lengths: Optional[torch.Tensor] = None,
    rejected_lengths: Optional[torch.Tensor] = None,
    dp_size: int = 1,
    global_batch_size: Union[int, torch.Tensor, None] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Preference loss on sequence log-probs.

    With the summed log-ratio margin
    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)):

    * ``"sigmoid"``: -log sigmoid(beta * h)  (DPO, Rafailov et al. 2023, eq. 7);
      with ``label_smoothing = eps`` the conservative variant
      -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
      (cDPO, Mitchell 2023, which assumes labels flipped with probability eps).
    * ``"ipo"``: (h_avg - 1 / (2 beta))^2  (IPO, Azar et al. 2023, arXiv:2310.12036, eq. 17,
      beta = tau), on the PER-TOKEN-AVERAGED margin
      h_avg = (log pi(y_w) - log pi_ref(y_w)) / |y_w| - (log pi(y_l) - log pi_ref(y_l)) / |y_l|,
      as the IPO authors' and TRL's implementations do: the fixed target 1/(2 beta)
      would otherwise be met by long pairs after a negligible per-token change and
      they would stop learning.  Needs ``chosen_lengths`` / ``rejected_lengths``.
    * ``"hinge"``: max(0, 1 - beta * h)  (SLiC-HF's calibration loss max(0, delta - h),
      Zhao et al. 2023, arXiv:2305.10425, eq. 1, on reference-normalised
      likelihoods with margin delta = 1/beta and scaled by beta, as in TRL).

    Implicit rewards are r = beta * (log pi - log pi_ref) on the summed log-probs
    (DPO eq. 5 up to the partition function), returned detached.

    Args:
        policy_chosen_logps: sum over tokens of log pi(y_w | x), nats, shape (batch,).
        policy_rejected_logps: sum of log pi(y_l | x), shape (batch,).
        reference_chosen_logps: sum of log pi_ref(y_w | x), shape (batch,).
        reference_rejected_logps: sum of log pi_ref(y_l | x), shape (batch,).
        beta: KL-regularisation strength (> 0).
        label_smoothing: eps in [0, 0.5), only for ``"sigmoid"``.
        loss_type: one of DPO_LOSS_TYPES.
        chosen_lengths / rejected_lengths: response tokens per pair, shape (batch,), > 0;
            required for ``"ipo"``, ignored otherwise.
        dp_size / global_batch_size: pairs in the whole mini-batch and the data-parallel
            size; the loss is then ``sum(losses) / global_batch_size * dp_size``, which
            summed over micro-batches and averaged over ranks is the mini-batch mean
            however it is split (see ``losses.agg_loss``).  Default: the batch mean.

    Returns:
        loss: scalar (differentiable w.r.t. the policy log-probs).
        chosen_rewards: (batch,) detached implicit rewards of the chosen responses.
        rejected_rewards: (batch,) detached implicit rewards of the rejected responses.
        metrics: python floats ``dpo/loss``, ``dpo/rewards_chosen``,
            ``dpo/rewards_rejected``, ``dpo/reward_margin`` (batch means) and
            ``dpo/reward_accuracy`` (fraction with chosen reward > rejected reward).

    Raises:
        ValueError: shape mismatch / non-1D inputs, beta <= 0, label smoothing
            outside [0, 0.5) or used with a non-sigmoid loss, unknown loss type,
            IPO without lengths or with a non-positive length.
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
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {list(DPO_LOSS_TYPES)}")

    chosen_log_ratio = policy_chosen_logps - reference_chosen_logps
    rejected_log_ratio = policy_rejected_logps - reference_rejected_logps
    h = chosen_log_ratio - rejected_log_ratio

    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='ipo' compares the per-token-averaged margin with 1/(2 beta): pass "
                             "chosen_lengths and rejected_lengths (response tokens per pair)")
        check_same_shape(policy_chosen_logps=policy_chosen_logps, chosen_lengths=chosen_lengths,
                         rejected_lengths=rejected_lengths)
        if bool((chosen_lengths <= 0).any() | (rejected_lengths <= 0).any()):
            raise ValueError("IPO needs every chosen / rejected length > 0 (an empty response has no per-token "
                             "average)")
        h_avg = chosen_log_ratio / chosen_lengths - rejected_log_ratio / rejected_lengths
        losses = (h_avg - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * h)

    n_pairs = losses.shape[0] if global_batch_size is None else global_batch_size
    loss = losses.sum() / max(int(n_pairs), 1) * dp_size
    chosen_rewards = beta * chosen_log_ratio.detach()
    rejected_rewards = beta * rejected_log_ratio.detach()
    metrics = {
        "dpo/loss": losses.detach().mean().item(),
        "dpo/rewards_chosen": chosen_rewards.mean().item(),
        "dpo/rewards_rejected": rejected_rewards.mean().item(),
        "dpo/reward_margin": (chosen_rewards - rejected_rewards).mean().item(),
        "dpo/reward_accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
    }
    return loss, chosen_rewards, rejected_rewards, metrics
