"""Which device each process group takes tensors on, and the one mover every placement of ours goes through.

A process group's backend takes tensors of some device types only: NCCL takes cuda tensors, gloo cpu ones
(torch's per-device backend strings, e.g. ``"cpu:gloo,cuda:nccl"``, give a group one backend per device type).
A tensor of another device type raises inside the collective (NCCL: "No backend type associated with device
type cpu").  megatron-core creates its groups (TP, PP, DP, EP, ...) with the default backend, which
`parallel.distributed.init_distributed` sets to NCCL exactly when CUDA is available, so on a GPU run every
megatron group takes cuda tensors and on the CPU cpu tensors.

Rules (docs/gpu.md, "Devices"):

* a role (actor, critic, reference: rlhf.workers.worker.MegatronWorker) moves each batch to
  `parallel.distributed.compute_device()` once, when the batch enters it, and its results back to the
  caller's device when they leave it; tensors computed inside a role are on the compute device;
* every collective of ours (rlhf/ and parallel/) hands its tensors through :func:`to_group_device`, so a tensor
  built on the host (a metric counter, say) reaches a group on the device that group takes;
* every move goes through :func:`to_device` (tests/support/fake_accelerator.py replaces it, with
  :func:`group_device` and ``compute_device``, to check on the CPU that nothing skips these placements).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import distributed

__all__ = ["BACKEND_DEVICE", "group_device_types", "group_device", "to_group_device", "to_device"]

#: device type a backend takes when it is named without a device map
BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ucc": "cuda", "xccl": "xpu"}


def group_device_types(group=None) -> list[str]:
    """Device types (``"cuda"``, ``"cpu"``, ...) the backend of `group` (None: the default group) takes, in
    the order of its backend string.  Raises ValueError for a backend this module does not know."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return [part.split(":", 1)[0].strip() for part in backend.split(",") if part.strip()]
    if backend not in BACKEND_DEVICE:
        raise ValueError(f"process group backend {backend!r}: no known device type; use one of "
                         f"{sorted(BACKEND_DEVICE)} or a device map such as 'cpu:gloo,cuda:nccl'")
    return [BACKEND_DEVICE[backend]]


def group_device(group=None) -> torch.device:
    """The device the collectives of `group` (None: the default group) are given tensors on: the compute device
    when the group's backend takes its type (no copy for what a role computed), else the first type the backend
    takes (``cuda:<current>`` for cuda).  megatron's groups: cuda under NCCL, cpu under gloo."""
    types = group_device_types(group)
    compute = distributed.compute_device()
    if compute.type in types:
        return compute
    if types[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(types[0])


def to_device(obj, device):
    """`obj` with every tensor in it on `device`: a tensor, or dicts / lists / tuples of them (other values as they
    are; a tensor already there is returned as is, no copy).  The one mover of the role seam and the collectives."""
    if torch.is_tensor(obj):
        return obj if obj.device == torch.device(device) else obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def to_group_device(t: torch.Tensor, group=None) -> torch.Tensor:
    """`t` on :func:`group_device` of `group` (no copy when it is there already), for a collective on `group`."""
    return to_device(t, group_device(group))
