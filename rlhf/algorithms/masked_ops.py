"""Masked reductions and whitening (verl ``torch_functional`` semantics).

``mask`` is a 0/1 tensor (bool, int or float) with the same shape as
``values``.  Masked-out entries are removed with ``torch.where`` before any
arithmetic, so padding that holds NaN or inf can never leak into a result.
"""

from typing import Optional

import torch

from rlhf.algorithms._validation import check_same_shape


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``axis`` (all elements if None).

    Shapes: ``values`` and ``mask`` identical; result is a scalar or has
    ``axis`` reduced.  Raises ValueError on a shape mismatch.
    """
    check_same_shape(values=values, mask=mask)
    kept = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    return kept.sum() if axis is None else kept.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``mask`` is non-zero.

    Shapes as :func:`masked_sum`.  An empty selection (mask all zero along
    the reduced axis) yields 0 rather than NaN, matching verl's
    ``sum / (count + 1e-8)`` convention without its 1e-8 bias.
    Raises ValueError on a shape mismatch.
    """
    total = masked_sum(values, mask, axis)
    count = mask.to(total.dtype)
    count = count.sum() if axis is None else count.sum(dim=axis)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``values`` (scalar, over all axes).

    With ``unbiased=True`` (verl's default) Bessel's correction n/(n-1) is
    applied, n being the number of valid entries.

    Raises:
        ValueError: shape mismatch; or ``unbiased`` and fewer than two valid
            entries (the unbiased variance is undefined), as in verl.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(variance.dtype).sum()
        if count < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 valid entries, got mask sum {count.item()}"
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to zero mean / unit variance over the masked entries.

    ``(values - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance
    taken over entries where ``mask`` is non-zero (one global statistic for
    the whole tensor, as verl does).  With ``shift_mean=False`` the mean is
    added back (only the scale changes).  Entries where ``mask`` is zero are
    returned as 0.

    When all valid entries are exactly equal the result is exactly 0 (or the
    value itself with ``shift_mean=False``): the computed mean can be 1 ulp off
    the common value, and dividing that residue by sqrt(0 + 1e-8) would turn it
    into a same-signed advantage of ~1e-4 relative size.

    Shapes: ``values`` and ``mask`` identical; output has the same shape.
    Raises ValueError on a shape mismatch or fewer than two valid entries.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    valid = mask != 0
    constant = values[valid].max() == values[valid].min()
    centered = torch.where(constant, torch.zeros_like(values), values - mean)
    whitened = centered * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = torch.where(constant, values, whitened + mean)
    return torch.where(valid, whitened, torch.zeros_like(whitened))
