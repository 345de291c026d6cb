"""SGLang's routed-experts capture (``enable_return_routed_experts``, MoE routing replay R3) on the CPU engine.

Why: SGLang 0.5.23's ``state_capturer/base.py`` allocates the host copy of the captured expert ids
(``BaseHostCache``) with ``pin_memory=True`` through ``ALLOC_MEMORY_FUNCS[device]``; on a CPU engine that is
``alloc_with_host_register``, which calls ``torch.cuda.cudart().cudaHostRegister`` and fails in the forked
scheduler ("Cannot re-initialize CUDA in forked subprocess"; without a driver: no CUDA at all), so the engine
cannot start.  Pinning only speeds up device-to-host copies, and a CPU engine has no device: the patch gives that
module an allocator that returns a plain CPU tensor (same shape, dtype, zeros).  Nothing else changes: the
capture, the copy into the host cache and the base64 return are SGLang's.
"""
from __future__ import annotations

TARGET = "sglang.srt.state_capturer.base"


def patch(module) -> None:
    import torch

    funcs = module.ALLOC_MEMORY_FUNCS.copy()  # a defaultdict: other devices keep their allocator

    def alloc_cpu(dims, dtype, device="cpu", pin_memory=False, allocator=None, registration_granularity_bytes=None):
        return torch.zeros(dims, dtype=dtype, device="cpu")

    funcs["cpu"] = alloc_cpu
    module.ALLOC_MEMORY_FUNCS = funcs


def install() -> None:
    """Patch now when the module is already imported, else when it is."""
    from ._after_import import after_import

    after_import(TARGET, patch)
