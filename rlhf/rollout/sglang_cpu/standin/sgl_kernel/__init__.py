"""CPU-only stand-in for SGLang's ``sgl_kernel`` package (development / CI without a GPU).

Why this exists
---------------
With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports CPU kernels from ``sgl_kernel`` that the PyPI wheel
does not ship (it carries only sm90/sm100 CUDA binaries), so the CPU engine cannot even import. This
package is put FIRST on ``PYTHONPATH`` of the engine process only (see ``rlhf.rollout.sglang_cpu``),
shadowing the real wheel there and nowhere else:

* every ``from sgl_kernel import X`` succeeds; ``X`` raises ``NotImplementedError`` when *called*, so a
  code path that really needs a missing kernel fails loudly instead of computing garbage;
* the few ``torch.ops.sgl_kernel.*`` CPU ops that a dense Llama/Qwen2 reaches with
  ``attention_backend="torch_native"`` are registered here in plain torch (RMSNorm, fused add+RMSNorm,
  SiLU-and-mul, thread binding);
* DeepSeek-V3's multi-latent attention prefill on the ``torch_native`` backend is corrected
  (``_mla_prefill``: SGLang attends over the latent cache instead of the keys/values it passes);
* the ``torch_native`` decode step attends for the whole batch in one call instead of SGLang's per-request
  Python loop (``_batched_attention``: the loop was the largest part of a CPU rollout);
* plain sampling (no top-k / top-p / min-p) draws one uniform per request (inverse CDF,
  ``_inverse_cdf_sampling``) instead of one exponential per vocabulary entry from torch's single-threaded CPU
  generator (the largest part of a decode step at a 32k vocabulary);
* ``convert_weight_packed`` is deliberately NOT registered: SGLang enables its Intel-AMX backend only when
  that op exists, so leaving it out keeps every linear layer on plain ``torch.nn.functional.linear``
  even on AMX-capable CPUs.

It is never imported on a GPU machine (``rlhf.rollout.sglang_cpu`` only adds it when CUDA is absent).
"""

import importlib
import os

import torch

__version__ = "0.0.0+rlhf-cpu-standin"


def _missing(name):
    def f(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel stand-in (rlhf.rollout.sglang_cpu): kernel {name!r} is not implemented on CPU; "
            "this code path needs the real sgl_kernel (GPU) build"
        )

    f.__name__ = name
    return f


def __getattr__(name):
    # Module-level __getattr__ (PEP 562): any imported name resolves to a raising placeholder.
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)


_lib = torch.library.Library("sgl_kernel", "DEF")


def _def(schema, fn):
    _lib.define(schema)
    _lib.impl(schema.split("(")[0], fn, "CompositeExplicitAutograd")


def _rms(x, w, eps):
    # Same math as SGLang's RMSNorm forward_native: statistics in fp32, result cast back, then weight.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rmsnorm_cpu(input, weight, eps):
    return _rms(input, weight, eps)


def fused_add_rmsnorm_cpu(input, residual, weight, eps):
    # In-place contract of the real kernel: residual += input; input = rmsnorm(residual).
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def silu_and_mul_cpu(input):
    d = input.shape[-1] // 2
    return torch.nn.functional.silu(input[..., :d]) * input[..., d:]


def init_cpu_threads_env(cpu_ids):
    # The real op pins OpenMP threads to cores; torch's default threading is good enough here.
    return "sgl_kernel stand-in: no thread binding"


_def("rmsnorm_cpu(Tensor input, Tensor weight, float eps) -> Tensor", rmsnorm_cpu)
_def("fused_add_rmsnorm_cpu(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()",
     fused_add_rmsnorm_cpu)
_def("silu_and_mul_cpu(Tensor input) -> Tensor", silu_and_mul_cpu)
_def("init_cpu_threads_env(str cpu_ids) -> str", init_cpu_threads_env)

if os.environ.get("RLHF_SGLANG_CPU_NOOP_CUDA_SYNC") == "1":
    # release/resume_memory_occupation call torch.get_device_module().synchronize(); with the mandatory
    # CUDA build of torch that is torch.cuda.synchronize, which raises "Found no NVIDIA driver" on CPU.
    # This module is imported by every SGLang process (scheduler ranks included), so patching here reaches
    # the process that actually runs the release. Only set when the engine runs on CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None

# DeepSeek-V3 (MLA) prefill on the torch_native backend: see _mla_prefill's docstring.  Imported by name: a
# `from sgl_kernel import _mla_prefill` would get this module's __getattr__ placeholder instead.
importlib.import_module(__name__ + "._mla_prefill").install()
# One batched attention call per decode / extend step instead of SGLang's per-request loop: see _batched_attention.
importlib.import_module(__name__ + "._batched_attention").install()
# One uniform per row instead of one exponential per vocabulary entry when sampling: see _inverse_cdf_sampling.
importlib.import_module(__name__ + "._inverse_cdf_sampling").install()
# SGLang's LoRA layers pin host memory, which needs a CUDA driver: see _lora_pinning.
importlib.import_module(__name__ + "._lora_pinning").install()
# SGLang's routed-experts capture (MoE routing replay R3) pins its host buffer with CUDA: see
# _routed_experts_host_cache.
importlib.import_module(__name__ + "._routed_experts_host_cache").install()
