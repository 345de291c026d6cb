"""CPU engine stand-in for ``flashinfer``: not importable in the CPU engine's processes.

Why: SGLang 0.5.23 imports flashinfer (a CUDA kernel library, with ``cutlass``) from modules every engine imports,
e.g. ``sglang.srt.layers.quantization.fp4_utils`` (``try: from flashinfer import fp4_quantize``); on CPU nothing
calls it, yet it costs ~70 MiB of private memory in the engine actor (shared with the scheduler it forks) --
benchmarks/README.md, "Where the memory goes".  This package shadows the installed one in the CPU engine's processes
only (rlhf.rollout.sglang_cpu puts this folder first on their PYTHONPATH; it is never on a GPU engine's path), and
its import raises ImportError, which every such SGLang import handles (``is_flashinfer_available()`` is False on
CPU anyway: it requires CUDA).  A code path that really needs flashinfer fails loudly with this message.
"""
raise ImportError("flashinfer is not available in the CPU engine (rlhf/rollout/sglang_cpu/standin/flashinfer: "
                  "a CUDA kernel library nothing on the CPU path calls)")
