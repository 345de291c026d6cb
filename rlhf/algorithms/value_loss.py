"""The critic's clipped value loss (PPO2 baselines / verl ``compute_value_loss``)."""

import torch

from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.aggregation import agg_loss
from rlhf.algorithms.masked_ops import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **global_info,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 baselines / verl):

        v_clip = clip(vpreds, values - cliprange_value, values + cliprange_value)
        loss   = 0.5 * agg(max((vpreds - returns)^2, (v_clip - returns)^2))

    Args:
        vpreds: current critic predictions, shape (bs, response_length).
        returns: return targets (e.g. from GAE), same shape.
        values: critic predictions at rollout time, same shape.
        response_mask: 1 for response tokens, same shape.
        cliprange_value: clip half-width, in reward units.
        loss_agg_mode: see :func:`agg_loss`.
        **global_info: ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` /
            ``loss_scale_factor`` forwarded to :func:`agg_loss`.

    Returns:
        vf_loss: scalar loss.
        vf_clipfrac: fraction of valid tokens where the clipped error was larger.

    Raises:
        ValueError: shape mismatch or unknown ``loss_agg_mode``.
    """
    check_2d("vpreds", vpreds)
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    valid = response_mask != 0
    vpreds, returns, values = (torch.where(valid, x, torch.zeros_like(x)) for x in (vpreds, returns, values))
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (vpred_clipped - returns) ** 2
    errors = torch.maximum(unclipped_error, clipped_error)
    vf_loss = 0.5 * agg_loss(errors, response_mask, loss_agg_mode, **global_info)
    vf_clipfrac = masked_mean((clipped_error > unclipped_error).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac
