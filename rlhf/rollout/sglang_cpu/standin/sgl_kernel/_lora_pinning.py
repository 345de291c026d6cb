"""SGLang's LoRA layers and torch-native LoRA backend on the CPU engine: no pinned host memory.

Why: SGLang 0.5.23 allocates its LoRA bookkeeping tensors (the output offsets of every LoRA-wrapped linear,
``sglang/srt/lora/layers.py``; the per-batch segment / rank / scaling tensors of the ``torch_native`` backend,
``sglang/srt/lora/backend/torch_backend.py``) with ``pin_memory=True`` or ``.pin_memory()``.  Pinning asks the CUDA
driver for page-locked memory, so on a machine without one the engine dies at start ("Found no NVIDIA driver").
Pinned memory only speeds up host-to-GPU copies; on the CPU engine every tensor is already where it is used, so the
patch drops the request: in those two modules ``torch`` is replaced by a view of it whose tensor factories ignore
``pin_memory``, and ``Tensor.pin_memory()`` returns the tensor itself in this process (a CPU engine process: GPU
engines never import this stand-in).  The values computed are unchanged.
"""
from __future__ import annotations

import functools
import types

import torch

TARGETS = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")


def _unpinned(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return make


class _TorchWithoutPinning(types.ModuleType):
    """``torch`` for a patched module: every attribute is torch's, the factories drop ``pin_memory``."""

    def __init__(self):
        super().__init__("torch")
        for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor"):
            setattr(self, name, _unpinned(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def patch(module) -> None:
    module.torch = _TorchWithoutPinning()


def install() -> None:
    """Register the patch of both modules and make ``Tensor.pin_memory`` the identity in this process."""
    from ._after_import import after_import

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for target in TARGETS:
        after_import(target, patch)
