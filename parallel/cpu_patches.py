"""CPU-only compatibility patches for megatron-core (gloo, no CUDA).

This is the ONE place where the trainer side bends megatron-core to run without a GPU, for
development and CI.  `apply_cpu_patches()` is a no-op when CUDA is available, so GPU clusters
run megatron-core unpatched.  Each patch says what breaks without it; each was shown necessary
(verified on megatron-core 0.13.1 - 0.16.1, see ../shared/reference/README.md).

Import this module BEFORE megatron.core (it also guards an sglang import side effect).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

_CPU = not torch.cuda.is_available()

# sglang depends on sgl-flash-mla, whose flash_mla/__init__ dlopens a CUDA .so and raises OSError
# (libcuda.so.1 missing) on a GPU-less machine.  megatron/core/transformer/attention.py only catches
# ImportError around `import flash_mla`, so without this 11 megatron.core modules (GPT layer specs,
# attention) fail to import.  A None entry makes `import flash_mla` raise ImportError instead.
if _CPU:
    sys.modules.setdefault("flash_mla", None)

_APPLIED = False


class CpuRNGStatesTracker:
    """Drop-in for megatron's CudaRNGStatesTracker that forks the CPU generator state.

    Without it `model_parallel_cuda_manual_seed` asserts on CUDA, and attention dropout forks the
    tracker even at p=0.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _install_cpu_rng_tracker() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recomputation saves/restores the "cuda" RNG state through these two helpers.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)


def model_parallel_cpu_manual_seed(seed: int) -> None:
    """CPU analogue of `megatron.core.tensor_parallel.model_parallel_cuda_manual_seed`.

    Seeds the default generator with `seed` and adds the data-parallel, model-parallel
    (seed + 2718 + tp_rank) and expert-parallel trackers exactly as megatron does on GPU.
    """
    from megatron.core import parallel_state as ps
    import megatron.core.tensor_parallel.random as mrandom

    _install_cpu_rng_tracker()
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank(),
    )


def _is_cuda_device(d) -> bool:
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, int) and not isinstance(d, bool)


_FACTORIES = ["tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "linspace", "eye", "empty_strided"]


class _CpuTorchProxy(types.ModuleType):
    """Stands in for the `torch` module inside megatron.core modules: factories with a CUDA
    device argument allocate on the CPU instead; every other attribute is torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)


class _CpuStream:
    """Stand-in for a CUDA stream / event on the CPU, where every op is already synchronous."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _CpuStream()


class _CpuCudaProxy(types.ModuleType):
    """Stands in for `torch.cuda` inside megatron.core modules: streams and events are no-ops.

    megatron's MoE all-to-all token dispatcher (transformer/moe/token_dispatcher.py) creates a
    `torch.cuda.Stream()` in its constructor and copies routing counts to the host on it; without
    this, building any MoE layer raises "CUDA driver version is insufficient".
    """

    Stream = _CpuStream
    Event = _CpuStream

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(device=None):
        return _CURRENT_STREAM

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


def _cpu_factory(orig):
    @functools.wraps(orig)
    def factory(*a, **k):
        if "device" in k and _is_cuda_device(k["device"]):
            k["device"] = "cpu"
        return orig(*a, **k)

    return factory


def _patch_cuda_literals() -> None:
    """Map hard-coded device='cuda' / .cuda() / .to('cuda') onto the CPU.

    megatron-core allocates with device='cuda' literals in optimizer.py, clip_grads.py,
    grad_scaler.py, pipeline_parallel/schedules.py (token counts), tensor_parallel/data.py,
    language_module.py (tied embeddings under PP) and transformer/utils.py; without this they
    raise "Found no NVIDIA driver".  Their `torch.cuda` streams/events become no-ops
    (`_CpuCudaProxy`, for the MoE token dispatcher).  Only megatron.core modules see the remapped factories (their
    `torch` global is replaced by a proxy): patching torch itself broke transformers' RoPE buffer
    initialisation.
    """
    import importlib

    for name in ("megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer",
                 "megatron.core.pipeline_parallel.schedules", "megatron.core.tensor_parallel.data",
                 "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.dist_checkpointing",
                 "megatron.core.transformer.utils", "megatron.core.transformer.moe.token_dispatcher"):
        importlib.import_module(name)
    proxy = _CpuTorchProxy("torch")
    for fname in _FACTORIES:
        setattr(proxy, fname, _cpu_factory(getattr(torch, fname)))
    proxy.cuda = _CpuCudaProxy("torch.cuda")
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("megatron.core") and getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    torch.Tensor.cuda = lambda self, *a, **k: self
    orig_to = torch.Tensor.to

    def to(self, *a, **k):
        if a and _is_cuda_device(a[0]):
            a = ("cpu",) + a[1:]
        if "device" in k and _is_cuda_device(k["device"]):
            k["device"] = "cpu"
        return orig_to(self, *a, **k)

    torch.Tensor.to = to


def _patch_tensor_type() -> None:
    """Report CPU float tensors under their CUDA type names.

    megatron's optimizers and clip_grads dispatch on `param.type() == 'torch.cuda.FloatTensor'`
    (optimizer.py, distrib_optimizer.py, clip_grads.py) and reject CPU tensors otherwise.
    """
    orig_type = torch.Tensor.type
    names = {"torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"}

    def type_(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw:
            t = orig_type(self)
            return "torch.cuda." + t[len("torch."):] if t in names else t
        return orig_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = type_


def patch_moe_without_te() -> None:
    """Define `te_general_gemm = None` in megatron's moe_utils when Transformer Engine is absent.

    megatron-core 0.16.1 imports `te_general_gemm` only inside `try: import transformer_engine`,
    yet the MoE router's gating (`RouterGatingLinearFunction`) tests `te_general_gemm is not None`
    unconditionally: without TE every MoE forward raises NameError.  None selects its plain torch
    matmul path.  Needed on any machine without TE (CPU or GPU); idempotent.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def patch_mla_without_te() -> None:
    """Set megatron's `multi_latent_attention.HAVE_TE = False` when Transformer Engine is absent.

    megatron-core 0.16.1's TE extension module imports without TE and leaves `TELinear` a
    MagicMock, so MLA's import guard sets HAVE_TE = True and `MLASelfAttention.__init__` then calls
    `isinstance(linear_proj, TELinear)` with a mock: TypeError on every machine without TE (CPU or
    GPU).  False skips that TE-only fp8 branch.  Idempotent.
    """
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _patch_moe_host_copies() -> None:
    """Make the MoE all-to-all dispatcher's "device -> host" copies of split sizes work on CPU.

    `maybe_move_tensor_to_cpu(t, as_numpy=True)` only converts CUDA tensors; on the CPU the split
    sizes stay tensors and `all_to_all_single` rejects them (TypeError) as soon as EP > 1.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_gloo_collectives() -> None:
    """All-gather / reduce-scatter with uneven split sizes for gloo.

    The MoE all-to-all dispatcher with expert tensor parallelism gathers (and in backward
    reduce-scatters) a different number of tokens per TP rank through
    `tensor_parallel.mappings._gather_along_first_dim(..., output_split_sizes)`, i.e.
    `dist.all_gather` into unequal tensors, which gloo rejects ("invalid tensor size").  Here the
    gather pads every rank's rows to the largest split and trims; the reduce-scatter all-reduces
    the whole tensor and keeps this rank's rows (same values, more traffic; CPU only).
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    orig_gather, orig_rs = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)], 0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return orig_rs(input_, group, input_split_sizes, use_global_buffer)
        full = input_.contiguous().clone()
        dist.all_reduce(full, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return full[start: start + input_split_sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def apply_cpu_patches() -> bool:
    """Apply every CPU patch once; returns True if patches are active (no CUDA), else False."""
    global _APPLIED
    if not _CPU:
        return False
    if _APPLIED:
        return True
    _APPLIED = True
    _install_cpu_rng_tracker()
    # GlobalMemoryBuffer, tensor-parallel gathers, DDP grad buffers and p2p allocate on
    # torch.cuda.current_device() (~57 files); "cpu" is a valid device argument for all of them.
    torch.cuda.current_device = lambda: "cpu"
    # Pipeline p2p, dist_checkpointing save and SGLang's release_memory_occupation call
    # torch.cuda.synchronize(), which raises without a driver; CPU ops are synchronous already.
    torch.cuda.synchronize = lambda *a, **k: None
    _patch_cuda_literals()
    _patch_tensor_type()
    patch_moe_without_te()
    _patch_moe_host_copies()
    _patch_uneven_gloo_collectives()
    return True


def cpu_patches_active() -> bool:
    return _APPLIED
