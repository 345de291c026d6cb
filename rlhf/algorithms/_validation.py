"""Small input checks shared by the algorithm functions.

Every public function validates its tensor arguments up front so that a shape
mismatch fails with a message naming the offending shapes instead of silently
broadcasting.
"""

import torch


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all keyword tensors have exactly the same shape.

    Example: ``check_same_shape(log_prob=a, old_log_prob=b)`` raises
    ``ValueError("shape mismatch: log_prob=(2, 3), old_log_prob=(2, 4)")``.
    """
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        described = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {described}")


def check_2d(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless ``tensor`` has shape (bs, response_length)."""
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape (bs, response_length), got {tuple(tensor.shape)}")


def check_1d(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless ``tensor`` has shape (batch,)."""
    if tensor.dim() != 1:
        raise ValueError(f"{name} must have shape (batch,), got {tuple(tensor.shape)}")
