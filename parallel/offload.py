"""Offload of a role's parameters, gradients and optimizer state while another phase runs (verl's
``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``).

What moves is *storage*, never a tensor object: every tensor of a part is reduced to the storage it views (megatron
DDP's contiguous ``buffers[i].param_data`` / ``grad_data`` that ``param.data`` / ``param.main_grad`` are views of,
the distributed optimizer's fp32 main-parameter shards, Adam's ``exp_avg`` / ``exp_avg_sq``), each storage is copied
whole into a host buffer and then resized to 0 bytes, which frees it on the device.  Loading resizes the same
storage back and copies the bytes in.  So every tensor and view object (the params megatron's buckets,
optimizer and our weight bridge hold) stays the one it was and aliases the contiguous buffer again, with the same
device, dtype, shape and values.

The host buffer is pinned CPU memory on an accelerator (copies are asynchronous, followed by one device
synchronize); when the role computes on the CPU it is a separate CPU allocation, so the original storage is
really released and restored and the same code path runs in CPU tests.  A host buffer is kept between cycles
(re-used when the storage's size is unchanged): host memory holds one copy of everything offloaded, byte for byte
(:func:`host_buffer`: on CUDA a plain CPU allocation page-locked with ``cudaHostRegister``, not torch's caching
host allocator, which rounds every request up to a power of two and keeps freed blocks cached).

Parts: ``params`` (model parameters), ``grads`` (megatron's main_grad buffers and the gradients of the optimizer's
main parameters), ``optimizer`` (main parameters that are not views of the model's, and the optimizer's state).
A storage shared by two parts (the fp32 distributed optimizer's main parameters ARE shards of the model's
param buffer) belongs to the first of params, grads, optimizer: it moves with that part only.

megatron-core's own ``_ParamAndGradBuffer.offload_to_cpu`` is not used: it pins unconditionally (no CPU path),
moves param buffers only under the distributed optimizer, drops gradient values, and leaves the optimizer alone.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

__all__ = ["PARTS", "RoleOffload", "role_tensors", "host_buffer"]

PARTS = ("params", "grads", "optimizer")


def _cuda_host_register(ptr: int, nbytes: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable (every context)
    if err:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed with cudaError {err} (page-locked "
                           f"memory limit? see `ulimit -l`); offload less (<role>.offload.*)")


def _cuda_host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_buffer(nbytes: int, device) -> torch.Tensor:
    """A uint8 CPU buffer of exactly ``nbytes`` for the storages of ``device``: on CUDA page-locked (asynchronous
    copies) with ``cudaHostRegister`` on a plain CPU allocation, unregistered when the buffer is freed (what torch's
    own ``distributed/_state_dict_utils._create_cpu_state_dict`` does); torch's caching host allocator
    (``pin_memory=True``) would round the request up to the next power of two (``CachingHostAllocator.h``,
    ``pinned_max_round_threshold`` unset) and keep freed blocks cached: up to twice the offloaded bytes.  Another
    accelerator type: torch's pinned memory; CPU: a plain allocation.

    Raises RuntimeError when CUDA refuses to register the memory."""
    device = torch.device(device)
    if device.type == "cuda" and nbytes:
        host = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        _cuda_host_register(host.data_ptr(), nbytes)
        weakref.finalize(host, _cuda_host_unregister, host.data_ptr()).atexit = False  # not after CUDA is gone
        return host
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=device.type != "cpu")


def _sub_optimizers(optimizer) -> list:
    if optimizer is None:
        return []
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if not getattr(o, "is_stub_optimizer",
                                                                                             False)]


def _tensors(obj) -> Iterator[torch.Tensor]:
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def role_tensors(chunks, optimizer=None) -> dict[str, list[torch.Tensor]]:
    """The tensors of each part (:data:`PARTS`) of a role: `chunks` (DDP-wrapped or plain GPTModel chunks) and its
    megatron `optimizer` (ChainedOptimizer / DistributedOptimizer / Float16Optimizer / FP32Optimizer, or None).
    Contiguous DDP buffers come first; a tensor may appear in several parts (see the module docstring)."""
    params, grads, opt = [], [], []
    for c in chunks:
        ddp_buffers = [] if callable(getattr(c, "buffers", None)) else list(c.buffers)  # a plain module: .buffers()
        for buf in ddp_buffers + list(getattr(c, "expert_parallel_buffers", [])):
            if buf.param_data is not None:
                params.append(buf.param_data)
            if buf.grad_data is not None:
                grads.append(buf.grad_data)
        for p in c.parameters():
            params.append(p.data)
            if getattr(p, "main_grad", None) is not None:
                grads.append(p.main_grad)
            if p.grad is not None:
                grads.append(p.grad)
    for o in _sub_optimizers(optimizer):
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups", "shard_fp32_groups",
                     "fp32_from_fp32_groups"):
            opt.extend(_tensors(getattr(o, name, None)))
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                opt.append(p.data)
                for g in (p.grad, getattr(p, "decoupled_grad", None)):
                    if g is not None:
                        grads.append(g)
        for state in inner.state.values():
            opt.extend(_tensors(state))
    return {"params": params, "grads": grads, "optimizer": opt}


class _Moved:
    """One offloaded storage: the storage object itself, its size, its host copy."""

    __slots__ = ("storage", "nbytes", "host")

    def __init__(self, storage, nbytes, host):
        self.storage, self.nbytes, self.host = storage, nbytes, host


class RoleOffload:
    """Moves the enabled `parts` (a subset of :data:`PARTS`) of one role (`chunks`, `optimizer`) off `device`
    (the role's compute device) between the phases that use them.

    :meth:`resident` is the one entry: inside ``with off.resident("params", ...)`` the named parts (those enabled)
    are on `device`; when the outermost block ends every enabled part is offloaded again.  Blocks nest (an
    inner block loads what it needs more, and leaves the offload to the outermost).  :meth:`offload` offloads
    outside any block (after the role is built).  ``log`` records ``(action, role, parts)`` for each
    ``"load"`` / ``"offload"`` that moved something, in order (the phase order tests read it).

    Raises ValueError for a part name not in :data:`PARTS`.
    """

    def __init__(self, chunks, optimizer, device, parts: Iterable[str], role: str = "role"):
        parts = tuple(parts)
        bad = [p for p in parts if p not in PARTS]
        if bad:
            raise ValueError(f"offload parts {bad}: use a subset of {list(PARTS)}")
        self.chunks, self.optimizer, self.role = chunks, optimizer, role
        self.device = torch.device(device)
        self.parts = tuple(p for p in PARTS if p in parts)
        self.pin = self.device.type != "cpu"  # pinned host memory and asynchronous copies on an accelerator
        self.moved: dict[str, list[_Moved]] = {}
        self.log: list[tuple[str, str, tuple]] = []
        self._host: dict[int, torch.Tensor] = {}  # StorageImpl address -> host buffer, kept between cycles
        self._depth = 0

    # ---- the storages of each part --------------------------------------------------------------------------
    def _storages(self) -> dict[str, list]:
        """part -> storages on the device that part owns (first of params, grads, optimizer), deduplicated."""
        tensors = role_tensors(self.chunks, self.optimizer)
        seen, out = set(), {}
        for part in PARTS:
            out[part] = []
            for t in tensors[part]:
                if t.device != self.device:
                    continue  # e.g. torch Adam's host-side 'step' counters on a GPU
                s = t.untyped_storage()
                key = s._cdata
                if key in seen or s.nbytes() == 0:
                    continue
                seen.add(key)
                out[part].append(s)
        return out

    def _sync(self) -> None:
        torch.get_device_module(self.device.type).synchronize()

    def _host_buffer(self, storage) -> torch.Tensor:
        key, n = storage._cdata, storage.nbytes()
        host = self._host.get(key)
        if host is not None and host.numel() != n:
            del self._host[key]
            host = None  # freed (and unregistered) before the new buffer is made
        if host is None:
            host = self._host[key] = host_buffer(n, self.device)
        return host

    # ---- moves ------------------------------------------------------------------------------------------
    def _offload_parts(self, parts) -> None:
        todo = [p for p in parts if p in self.parts and p not in self.moved]
        if not todo:
            return
        storages = self._storages()
        batch = {}
        for part in todo:
            batch[part] = []
            for s in storages[part]:
                host = self._host_buffer(s)
                host.untyped_storage().copy_(s, non_blocking=self.pin)
                batch[part].append(_Moved(s, s.nbytes(), host))
        self._sync()  # every copy has landed before a device byte is freed
        for part, moved in batch.items():
            for m in moved:
                m.storage.resize_(0)
            self.moved[part] = moved
        self.log.append(("offload", self.role, tuple(todo)))

    def _load_parts(self, parts) -> None:
        todo = [p for p in parts if p in self.moved]
        if not todo:
            return
        for part in todo:
            for m in self.moved.pop(part):
                m.storage.resize_(m.nbytes)
                m.storage.copy_(m.host.untyped_storage(), non_blocking=self.pin)
        self._sync()  # the role's first kernel reads restored bytes; the host buffers may be rewritten next cycle
        self.log.append(("load", self.role, tuple(todo)))

    def offload(self) -> None:
        """Offload every enabled part now (nothing inside a :meth:`resident` block)."""
        if self._depth == 0:
            self._offload_parts(self.parts)

    def is_offloaded(self, part: str) -> bool:
        """Whether `part` is off the device now."""
        return part in self.moved

    @contextmanager
    def resident(self, *parts: str):
        """Inside the block the named `parts` (default all) are on the device; the outermost block offloads every
        enabled part when it ends (also on an exception)."""
        bad = [p for p in parts if p not in PARTS]
        if bad:
            raise ValueError(f"offload parts {bad}: use a subset of {list(PARTS)}")
        self._load_parts(parts or PARTS)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._offload_parts(self.parts)
