"""A fake accelerator: checks on the CPU that tensors reach megatron's process groups on the device those groups
take, as NCCL demands on a GPU run (a cpu tensor given to an NCCL group raises "No backend type associated with
device type cpu"; torch refuses the same way on the CPU for a group made with ``backend="cuda:gloo"``,
tests/unit/parallel/test_devices.py).

On the CPU every real tensor is a cpu tensor, so a check of ``tensor.device`` alone cannot tell a batch the
trainer built (host memory on a GPU run) from one a role moved to its device.  Here "on the accelerator"
is a property a tensor carries:

* a tensor is ON THE ACCELERATOR when it is an :class:`OnAccel` (a cpu tensor of that subclass) or shares storage
  with a registered model parameter (:meth:`FakeAccelerator.register_model`: the models live on the
  accelerator, and their outputs are tagged).  torch carries the subclass through ops, as a real device is
  carried: what is computed from a tensor on the accelerator is on the accelerator, what is computed from host
  tensors only is on the host.  (Emulation limits: a tensor computed from parameters alone counts as host, as do
  megatron's inner activations; every collective of ours places its tensors with parallel.devices anyway.  And
  forward_backward hands a model output back with ``.to(batch device)``, which keeps the tag, so a host batch
  is caught where it enters forward_backward, not at the gathers after it.)
* :func:`parallel.distributed.compute_device` and :func:`parallel.devices.group_device` answer ``ACCEL`` (the
  label of the accelerator, the meta device: a real move there would lose the data and fail loudly), and
  :func:`parallel.devices.to_device`, the one mover, puts the tag on (to ``ACCEL``) or takes it off with a copy
  (to the host).  So exactly the code paths that place tensors on a GPU run place them here.
* the guard: every tensor collective of torch.distributed (all_reduce, all_gather, gather, broadcast, ...)
  called from the project's code (rlhf/, parallel/) checks that each tensor is on the device
  ``parallel.devices.group_device(group)`` names, and raises as NCCL would; and every batch a role hands to
  megatron's schedule (parallel.forward.forward_backward, as rlhf.workers.worker calls it) must be on the role's
  device, since forward_backward returns its outputs on the batch's device (a host batch on a GPU gives host
  outputs, which the data-parallel gathers then give to NCCL).  megatron's own collectives (gradient buffers,
  TP activations inside its layers) are counted, not checked: their placement is megatron's.

What it does not catch: a host tensor mixed with an accelerator tensor in one op (torch raises for that on a
GPU; here the result is simply on the accelerator).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys

import torch
import torch.distributed as dist

from tests.support.paths import ROOT

ACCEL = torch.device("meta")
OURS = tuple(os.path.join(ROOT, pkg) + os.sep for pkg in ("rlhf", "parallel"))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
               "gather", "scatter", "broadcast", "reduce", "all_to_all_single", "send", "recv", "isend", "irecv")


class OnAccel(torch.Tensor):
    """A cpu tensor that counts as living on the fake accelerator (torch's default subclass propagation keeps the
    results of ops on it OnAccel)."""


class DeviceError(RuntimeError):
    """A tensor reached a collective (or a role's compute) on a device its group does not take."""


class FakeAccelerator:
    """Installs the fake accelerator and the guard (``with FakeAccelerator() as fa:``); ``fa.violations`` lists
    what was caught (each also raised at the call, as the GPU run would crash there), ``fa.checked`` counts the
    checked collectives by name and ``fa.unchecked`` megatron's own."""

    def __init__(self, raise_on_violation: bool = True):
        self.raise_on_violation = raise_on_violation
        self.violations: list[str] = []
        self.checked: dict[str, int] = {}
        self.unchecked = 0
        self._storages: set[int] = set()
        self._stack = contextlib.ExitStack()

    # ---- where a tensor is -------------------------------------------------------------------
    def device_of(self, t: torch.Tensor) -> torch.device:
        """ACCEL for a tensor on the fake accelerator, else its real device."""
        if isinstance(t, OnAccel) or (t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._storages):
            return ACCEL
        return t.device

    def register_model(self, modules) -> None:
        """`modules` (a role's model chunks) live on the accelerator: their parameters (and megatron's gradient
        buffers, through ``main_grad``) and what their GPTModels compute (a forward hook tags the output; megatron's
        autograd functions hand back plain tensors, so inner activations do not carry the tag themselves)."""
        for m in modules:
            for sub in m.modules():
                if type(sub).__name__ == "GPTModel" and not getattr(sub, "_on_fake_accel", False):
                    sub.register_forward_hook(lambda mod, args, out: out.as_subclass(OnAccel)
                                              if torch.is_tensor(out) and not isinstance(out, OnAccel) else out)
                    sub._on_fake_accel = True
            for p in m.parameters():
                self._storages.add(p.untyped_storage().data_ptr())
                grad = getattr(p, "main_grad", None)
                if grad is not None:
                    self._storages.add(grad.untyped_storage().data_ptr())

    def to_device(self, obj, device):
        """parallel.devices.to_device on the fake accelerator: to ACCEL tags, to the host copies the tag away."""
        if torch.is_tensor(obj):
            on_accel = self.device_of(obj) == ACCEL
            if torch.device(device) == ACCEL:
                return obj if isinstance(obj, OnAccel) else obj.as_subclass(OnAccel)
            if on_accel:
                return obj.as_subclass(torch.Tensor).clone().to(device)
            return obj if obj.device == torch.device(device) else obj.to(device)
        if isinstance(obj, dict):
            return {k: self.to_device(v, device) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.to_device(v, device) for v in obj)
        return obj

    # ---- the guard -----------------------------------------------------------------------------
    def _fail(self, msg: str) -> None:
        self.violations.append(msg)
        if self.raise_on_violation:
            raise DeviceError(msg)

    def check_tensors(self, tensors, expected: torch.device, what: str) -> None:
        """Fail (DeviceError, as NCCL would) for any of `tensors` not on `expected`."""
        for t in tensors:
            where = self.device_of(t)
            if where.type != expected.type:
                self._fail(f"{what}: a {tuple(t.shape)} {t.dtype} tensor on {where.type} (the group takes "
                           f"{expected.type}; on a GPU run: 'No backend type associated with device type {where.type}')")

    def _wrap_collective(self, name: str, original):
        sig = inspect.signature(original)
        guard = self

        def collective(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OURS):
                bound = sig.bind_partial(*args, **kwargs)
                tensors = []
                for value in bound.arguments.values():
                    if torch.is_tensor(value):
                        tensors.append(value)
                    elif isinstance(value, (list, tuple)):
                        tensors.extend(v for v in value if torch.is_tensor(v))
                group = bound.arguments.get("group")
                where = f"{name} at {os.path.relpath(caller, ROOT)}:{sys._getframe(1).f_lineno}"
                guard.check_tensors(tensors, guard.group_device(group), where)
                guard.checked[name] = guard.checked.get(name, 0) + 1
            else:
                guard.unchecked += 1
            return original(*args, **kwargs)

        collective.__wrapped__ = original  # P2POp accepts only torch's own isend / irecv (see _p2p_op)
        return collective

    def _wrap_batch_p2p(self, original):
        """``batch_isend_irecv`` checked as a collective: each P2POp's tensor on its group's device."""
        guard = self

        def batch_isend_irecv(p2p_op_list):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OURS):
                where = f"batch_isend_irecv at {os.path.relpath(caller, ROOT)}:{sys._getframe(1).f_lineno}"
                for op in p2p_op_list:
                    guard.check_tensors([op.tensor], guard.group_device(op.group), where)
                guard.checked["batch_isend_irecv"] = guard.checked.get("batch_isend_irecv", 0) + 1
            else:
                guard.unchecked += 1
            return original(p2p_op_list)

        return batch_isend_irecv

    @staticmethod
    def _p2p_op(original):
        """``dist.P2POp`` given the guard's isend / irecv: built with torch's own (its constructor checks identity)."""
        def p2p_op(op, *args, **kwargs):
            return original(getattr(op, "__wrapped__", op), *args, **kwargs)

        return p2p_op

    def group_device(self, group=None) -> torch.device:
        """parallel.devices.group_device on the fake accelerator: every group takes the accelerator's tensors
        (a GPU run: NCCL)."""
        return ACCEL

    def compute_device(self) -> torch.device:
        return ACCEL

    def _wrap_forward_backward(self, original):
        guard = self

        def forward_backward(model_chunks, batch, **kwargs):
            tensors = [v for v in batch.values() if torch.is_tensor(v)]
            guard.check_tensors(tensors, ACCEL, "a role's batch given to forward_backward")
            return original(model_chunks, batch, **kwargs)

        return forward_backward

    def __enter__(self):
        from unittest import mock

        import parallel.devices
        import parallel.distributed
        import rlhf.workers.worker

        patches = [mock.patch.object(parallel.devices, "to_device", self.to_device),
                   mock.patch.object(parallel.devices, "group_device", self.group_device),
                   mock.patch.object(parallel.distributed, "compute_device", self.compute_device),
                   mock.patch.object(rlhf.workers.worker, "forward_backward",
                                     self._wrap_forward_backward(rlhf.workers.worker.forward_backward))]
        patches += [mock.patch.object(dist, name, self._wrap_collective(name, getattr(dist, name)))
                    for name in COLLECTIVES]
        patches += [mock.patch.object(dist, "batch_isend_irecv", self._wrap_batch_p2p(dist.batch_isend_irecv)),
                    mock.patch.object(dist, "P2POp", self._p2p_op(dist.P2POp))]
        for p in patches:
            self._stack.enter_context(p)
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False
