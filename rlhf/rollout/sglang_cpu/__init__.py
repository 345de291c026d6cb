"""Everything SGLang needs to run on a CPU-only machine, in one place.

SGLang 0.5.x targets GPUs; its CPU engine works for dense Llama/Qwen2-style models once a few things are
arranged. None of this is used when CUDA is available. Each item says why it is needed:

Environment of the engine process (:func:`cpu_engine_env`):

* ``SGLANG_USE_CPU_ENGINE=1`` -- selects SGLang's CPU code paths (device "cpu", CPU memory pools).
* ``PYTHONPATH`` starts with :data:`STANDIN_DIR` -- the CPU engine imports ``sgl_kernel`` CPU ops that the
  PyPI wheel lacks; ``standin/sgl_kernel`` provides them in plain torch (see its docstring). Only the
  engine's own process tree sees it; the trainer keeps the real package.
* the same stand-in corrects DeepSeek-V3's multi-latent attention prefill on ``torch_native`` (SGLang 0.5.23
  attends over the latent KV cache instead of the per-head keys/values it passes: greedy tokens differed from
  transformers' from the first one; ``standin/sgl_kernel/_mla_prefill.py``).
* the same stand-in replaces two per-step costs of SGLang's CPU path by equivalent batched torch code:
  ``torch_native`` attention loops over the requests of a batch in Python (one SDPA call per request and
  layer; ``standin/sgl_kernel/_batched_attention.py`` makes it one call per layer, same outputs), and plain
  sampling draws one exponential variate per vocabulary entry from torch's single-threaded CPU generator
  (``standin/sgl_kernel/_inverse_cdf_sampling.py`` draws one uniform per request, same distribution).  A
  grpo_tiny_cpu round went from 0.29 to 0.16 s and a 40M-Llama round (32k vocabulary, 64 x 64 tokens) from
  15.0 to 6.7 s (benchmarks/engine_ab.py, old and new stand-in side by side, load ~10).
* the same stand-in lets SGLang's routed-experts capture (``enable_return_routed_experts``, MoE routing replay
  R3) start: its host buffer is allocated pinned with ``cudaHostRegister``, which fails in a CPU engine's forked
  scheduler; a plain CPU tensor takes its place (``standin/sgl_kernel/_routed_experts_host_cache.py``).
* ``standin/flashinfer`` -- an import of flashinfer (CUDA kernels, pulling in cutlass) raises ImportError in the
  engine's processes: SGLang imports it, guarded, from modules every engine loads, nothing on the CPU path calls it,
  and it held ~86 MiB of the engine pair's memory (PSS of the actor and its scheduler, quickstart model: 1,089 ->
  1,002 MiB).
* the same stand-in lets SGLang's LoRA run (``enable_lora``: the actor's adapters synced as adapters): its LoRA
  layers and ``torch_native`` LoRA backend ask for pinned host memory, which needs a CUDA driver; on the CPU engine
  nothing is pinned (``standin/sgl_kernel/_lora_pinning.py``; same values).
* ``RLHF_SGLANG_CPU_NOOP_CUDA_SYNC=1`` -- read by the stand-in: ``release_memory_occupation`` /
  ``resume_memory_occupation`` call ``torch.cuda.synchronize`` which raises without a driver; the
  stand-in replaces it with a no-op inside SGLang's processes.
* ``OMP_NUM_THREADS`` = the cores of this process / ``tp_size`` -- the engine actor is a zero-CPU Ray actor,
  for which Ray sets ``OMP_NUM_THREADS=1`` (and the launcher's CPU ranks get cores / ranks), and SGLang's
  scheduler inherits it: generation would use one core while the trainer, waiting for the rollout, leaves the
  others idle.  The engine and the trainer take turns (the trainer waits while the engine generates; the idle
  scheduler sleeps, ``sleep_on_idle``, while the trainer computes), so each may use every core.
* ``OMP_WAIT_POLICY=PASSIVE`` -- with several threads, OpenMP's default waits at each parallel region's end by
  spinning; when the machine has more runnable threads than cores, a spinning thread takes the core of the
  thread it waits for: a grpo_tiny_cpu round took 9-12 s with 2 spinning threads against 0.2-0.9 s with one
  (load 23-30 on 2 cores), and 0.21 s with 2 passive threads (0.24 s with one; benchmarks/engine_ab.py).
* for ``tp_size`` > 1, ``SGLANG_CPU_OMP_THREADS_BIND`` (one ``|``-separated core list per TP rank) --
  without it SGLang wants one NUMA node per TP rank and asserts for ``tp_size`` > number of NUMA nodes.
* for ``tp_size`` > 1, ``SGLANG_NCCL_SO_PATH`` pointing to a file that does not exist -- for ``tp_size`` > 1 SGLang otherwise
  loads pynccl, which rejects CPU tensors; a missing library makes it fall back to torch.distributed (gloo).

Process start (:func:`forked_subprocesses`, used by :func:`rlhf.rollout.sglang_engine.engine_class`):

* SGLang's scheduler processes are forked from the engine actor, which has imported SGLang already, instead of
  spawned (SGLang sets ``spawn`` for CUDA, which cannot be forked): a spawned scheduler imports SGLang, torch
  and transformers again (the longest part of an engine's start) and holds its own copy of them (~0.85 GB);
  a forked one shares the actor's pages.  Measured on the quickstart model (load ~25 on 2 cores): engine start
  11 s instead of 77 s, the engine's processes 1.0 GB of PSS instead of 1.6 GB, greedy tokens and log-probs
  identical.  The actor's garbage collector is frozen before the fork, so no collection in the scheduler
  writes to (and copies) the shared pages.

Engine keyword arguments (:func:`cpu_engine_kwargs`):

* ``device="cpu"``;
* ``attention_backend="torch_native"`` -- the default CPU backend (``intel_amx``) needs real sgl_kernel ops;
* ``disable_cuda_graph=True``, ``skip_server_warmup=True`` -- nothing to capture on CPU; warm-up costs
  start-up time;
* ``max_total_tokens`` (default 2048 when the caller gives none) -- on CPU SGLang sizes the KV pool from host
  memory; a bounded pool keeps start-up fast and memory small.  The trainer passes ``rollout.max_total_tokens``
  or the batch-sized value of :func:`rlhf.rollout.engine_args.batch_kv_tokens`.
* ``lora_backend="torch_native"`` -- used only with ``enable_lora``; SGLang's other LoRA backends are Triton / CUDA
  kernels.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional

__all__ = ["STANDIN_DIR", "use_cpu_engine", "cpu_engine_env", "cpu_engine_kwargs", "omp_threads_bind",
           "engine_threads", "forked_subprocesses"]

#: Directory holding the ``sgl_kernel`` and ``flashinfer`` stand-in packages (put first on the engine's PYTHONPATH).
STANDIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")

#: A path that must not exist: SGLang tries to dlopen it as libnccl and falls back when it is missing.
_NO_NCCL_SO = "/nonexistent/rlhf-sglang-cpu/libnccl.so.2"


def use_cpu_engine(device: Optional[str] = None) -> bool:
    """True when the SGLang engine should run on CPU.

    Args:
        device: "cpu" / "cuda" to force a choice; None = CPU exactly when ``torch.cuda.is_available()`` is False.
    Raises:
        ValueError: for any other ``device`` value.
    """
    if device is not None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None, got {device!r}")
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def omp_threads_bind(tp_size: int, num_cores: Optional[int] = None) -> str:
    """Value for ``SGLANG_CPU_OMP_THREADS_BIND``: one core list per TP rank, joined by ``|``.

    Cores are split into ``tp_size`` contiguous groups when there are enough (8 cores, tp 2 -> "0-3|4-7"; 2 cores, tp 2 -> "0|1");
    with fewer cores than ranks, ranks share cores round-robin (2 cores, tp 4 -> "0|1|0|1").
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if num_cores is not None:
        cores = list(range(int(num_cores)))
    elif hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    n = len(cores)
    if n >= tp_size:
        per = n // tp_size
        groups = [_core_list(cores[r * per:(r + 1) * per]) for r in range(tp_size)]
    else:
        groups = [str(cores[r % n]) for r in range(tp_size)]
    return "|".join(groups)


def engine_threads(tp_size: int, num_cores: Optional[int] = None) -> int:
    """Torch threads of each of an engine's ``tp_size`` scheduler ranks: this process's cores (its CPU affinity,
    or ``num_cores``) split evenly between the ranks, at least 1."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if num_cores is None:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, int(num_cores) // tp_size)


def _core_list(cores) -> str:
    # SGLang's documented format: "0-31" for a contiguous range, else comma-separated ids.
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


def cpu_engine_env(tp_size: int = 1, base_env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for a process that will create a CPU ``sglang.Engine`` (see module docstring).

    Args:
        tp_size: the engine's tensor-parallel size (number of SGLang scheduler ranks).
        base_env: environment to extend (default: a copy of ``os.environ``); not modified.
    Returns:
        a new dict: ``base_env`` plus the CPU settings, with :data:`STANDIN_DIR` first on ``PYTHONPATH``.
    """
    env = dict(os.environ if base_env is None else base_env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["RLHF_SGLANG_CPU_NOOP_CUDA_SYNC"] = "1"
    old = env.get("PYTHONPATH", "")
    parts = [p for p in old.split(os.pathsep) if p and os.path.abspath(p) != STANDIN_DIR]
    env["PYTHONPATH"] = os.pathsep.join([STANDIN_DIR] + parts)
    env["OMP_NUM_THREADS"] = str(engine_threads(tp_size))
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    if tp_size > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(tp_size)
        env["SGLANG_NCCL_SO_PATH"] = _NO_NCCL_SO
    return env


@contextlib.contextmanager
def forked_subprocesses():
    """Inside the block, ``multiprocessing.Process`` starts by fork (see the module docstring); the previous
    default start method is restored after it."""
    import gc
    import multiprocessing as mp

    previous = mp.get_start_method(allow_none=True)
    gc.freeze()
    mp.set_start_method("fork", force=True)
    try:
        yield
    finally:
        mp.set_start_method(previous, force=True)


def cpu_engine_kwargs(max_total_tokens: int = 2048) -> Dict[str, object]:
    """Extra ``sglang.Engine`` keyword arguments for CPU (see module docstring)."""
    return dict(
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        skip_server_warmup=True,
        max_total_tokens=int(max_total_tokens),
        lora_backend="torch_native",  # LoRA adapters (enable_lora): SGLang's other backends are Triton/CUDA kernels
    )
