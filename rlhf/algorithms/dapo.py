"""DAPO helpers (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv:2503.14476): overlong reward shaping and
dynamic-sampling group filter, the sampling-side pieces (the trainer's loop is
rlhf/trainer/dynamic_sampling.py).  DAPO's token-level pieces, the decoupled clip ranges and
``loss_agg_mode="token-mean"``, are in policy_losses/ppo.py and aggregation.py.
"""

from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

from rlhf.algorithms.grouping import GroupIndex, group_ids
from rlhf.algorithms._validation import check_1d


def compute_overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Soft overlong punishment, DAPO eq. 13, scaled by ``penalty_factor``.
    With L_max = max_response_length, L_cache = overlong_buffer_len, L = length:

        0                                      if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache * f  if L_max - L_cache < L <= L_max
        -f                                     if L > L_max

    Example (L_max=20, L_cache=4, f=1): lengths 16 -> 0, 17 -> -0.25,
    18 -> -0.5, 20 -> -1, 21 -> -1.

    Args:
        response_lengths: number of generated tokens per response, shape (bs,).
        max_response_length: L_max, in tokens.
        overlong_buffer_len: L_cache, in tokens, 0 < L_cache <= L_max.
        penalty_factor: f >= 0, the penalty at and beyond L_max.

    Returns:
        Float tensor of shape (bs,), values in [-f, 0], to add to the reward.

    Raises:
        ValueError: non-1D lengths, or invalid buffer / factor.
    """
    check_1d("response_lengths", response_lengths)
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths = response_lengths if response_lengths.is_floating_point() else response_lengths.float()
    expected_max = max_response_length - overlong_buffer_len
    in_buffer = (expected_max - lengths) / overlong_buffer_len * penalty_factor
    penalty = torch.clamp(in_buffer, max=0.0)
    return torch.where(lengths > max_response_length, torch.full_like(penalty, -penalty_factor), penalty)


def filter_groups_by_metric(
    metric_values: Union[torch.Tensor, np.ndarray, Sequence[float]],
    index: GroupIndex,
    keep_singleton_groups: bool = True,
) -> torch.Tensor:
    """Dynamic-sampling filter, DAPO eq. 11 constraint 0 < |{correct}| < G:
    keep the samples of prompt groups whose metric values are not all equal
    (std > 0); groups where every response scored the same give GRPO zero
    advantage and hence no gradient.

    Equality is tested exactly (max == min per group), so float round-off in
    a std can not keep an all-equal group.  Groups of size 1 are kept by
    default, as in verl's DAPO trainer (``std > 0 or len == 1``).

    Args:
        metric_values: per-sample metric (e.g. accuracy or sequence score), shape (bs,).
        index: (bs,) prompt uids.
        keep_singleton_groups: keep groups with a single sample.

    Returns:
        Bool tensor of shape (bs,), True for samples to keep.

    Raises:
        ValueError: non-1D metric, ``len(index) != bs``, or a non-finite metric value
            (a NaN would silently drop its whole group: NaN > NaN is False).
    """
    if isinstance(metric_values, torch.Tensor):
        values = metric_values.detach().to(torch.float64)
    else:
        values = torch.as_tensor(np.asarray(metric_values, dtype=np.float64))
    check_1d("metric_values", values)
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"metric_values is non-finite at sample(s) {bad[:5]}; score unscorable samples with the "
                         "fallback score (counted in reward/num_fallbacks) before filtering")
    gid, n_groups = group_ids(index, values.shape[0], values.device)
    group_max = torch.full((n_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    group_min = torch.full((n_groups,), torch.inf, dtype=values.dtype, device=values.device)
    group_max = group_max.scatter_reduce(0, gid, values, reduce="amax")
    group_min = group_min.scatter_reduce(0, gid, values, reduce="amin")
    group_size = torch.bincount(gid, minlength=n_groups)
    keep_group = group_max > group_min
    if keep_singleton_groups:
        keep_group = keep_group | (group_size == 1)
    return keep_group[gid]
