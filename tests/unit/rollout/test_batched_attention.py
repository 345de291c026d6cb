"""The CPU engine's batched torch_native attention (rlhf/rollout/sglang_cpu/standin/sgl_kernel/_batched_attention.py)
against SGLang's own per-request loop (sglang 0.5.23 TorchNativeAttnBackend), on random KV pools whose unused slots
hold NaN: equal outputs for decode and extend (with cached prefixes), GQA and MLA-like head sizes; the cases the
batched path does not take (sliding window, no causal mask) still go through SGLang's loop."""
import os
import types

import pytest
import torch

from rlhf.rollout import sglang_cpu
from tests.support.cpu_standin import load_standin_module

backend = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
SGLang = backend.TorchNativeAttnBackend


batched = load_standin_module("_batched_attention")


def _pool(lens, hkv, d, dv, pool=160, seed=0):
    """KV pool with NaN everywhere but the requests' slots, a shuffled req_to_token, req_pool_indices."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((pool, hkv, d), float("nan"))
    v = torch.full((pool, hkv, dv), float("nan"))
    req_to_token = torch.zeros((8, 64), dtype=torch.int32)
    slots = torch.randperm(pool, generator=g)
    req_pool_indices = torch.tensor([6, 1, 4, 0, 3][:len(lens)], dtype=torch.int64)
    used = 0
    for row, n in zip(req_pool_indices.tolist(), lens):
        s = slots[used:used + n]
        used += n
        req_to_token[row, :n] = s.to(torch.int32)
        k[s] = torch.randn((n, hkv, d), generator=g)
        v[s] = torch.randn((n, hkv, dv), generator=g)
    return k, v, req_to_token, req_pool_indices


@pytest.mark.parametrize("hq,hkv,d,dv", [(4, 2, 16, 16), (4, 4, 8, 8), (3, 1, 24, 16)])
def test_decode_equals_sglang_loop(hq, hkv, d, dv):
    lens = [1, 7, 3, 12, 5]
    k, v, r2t, rpi = _pool(lens, hkv, d, dv)
    q = torch.randn(len(lens), hq, d)
    seq_lens = torch.tensor(lens)
    want = SGLang._run_sdpa_forward_decode(None, q, torch.empty(len(lens), hq, dv), k, v, r2t, rpi, seq_lens,
                                            scaling=0.3, enable_gqa=hq != hkv)
    got = batched.batched_decode(q, torch.empty(len(lens), hq, dv), k, v, r2t, rpi, seq_lens, scaling=0.3,
                                 enable_gqa=hq != hkv)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("hq,hkv,d,dv", [(4, 2, 16, 16), (3, 1, 24, 16)])
def test_extend_with_cached_prefixes_equals_sglang_loop(hq, hkv, d, dv):
    prefix = [0, 3, 2, 0, 4]
    new = [1, 4, 1, 12, 1]
    lens = [p + n for p, n in zip(prefix, new)]
    k, v, r2t, rpi = _pool(lens, hkv, d, dv, seed=1)
    q = torch.randn(sum(new), hq, d)
    args = (k, v, r2t, rpi, torch.tensor(lens), torch.tensor(prefix), torch.tensor(new))
    want = SGLang._run_sdpa_forward_extend(None, q, torch.empty(sum(new), hq, dv), *args, scaling=0.25,
                                            enable_gqa=hq != hkv, causal=True)
    got = batched.batched_extend(q, torch.empty(sum(new), hq, dv), *args, scaling=0.25, enable_gqa=hq != hkv)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want)


def test_patch_routes_only_the_plain_case():
    cls = type("Backend", (SGLang,), {})
    batched.patch(types.SimpleNamespace(TorchNativeAttnBackend=cls))
    batched.patch(types.SimpleNamespace(TorchNativeAttnBackend=cls))  # idempotent
    assert cls._run_sdpa_forward_decode._rlhf_batched
    lens = [2, 9, 4]
    k, v, r2t, rpi = _pool(lens, 2, 8, 8, seed=2)
    q = torch.randn(3, 4, 8)
    seq_lens = torch.tensor(lens)
    calls = []
    real = batched.batched_decode
    batched.batched_decode = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        backend_obj = object.__new__(cls)
        plain = backend_obj._run_sdpa_forward_decode(q, torch.empty(3, 4, 8), k, v, r2t, rpi, seq_lens,
                                                     enable_gqa=True)
        assert calls == [1]
        # a sliding window of 2 tokens: SGLang's loop with its window mask (the batched path has none)
        windowed = backend_obj._run_sdpa_forward_decode(q, torch.empty(3, 4, 8), k, v, r2t, rpi, seq_lens,
                                                        enable_gqa=True, sliding_window_size=2)
        assert calls == [1]
    finally:
        batched.batched_decode = real
    want = SGLang._run_sdpa_forward_decode(object.__new__(SGLang), q, torch.empty(3, 4, 8), k, v, r2t, rpi,
                                            seq_lens, enable_gqa=True, sliding_window_size=2)
    torch.testing.assert_close(windowed, want)
    assert not torch.allclose(windowed[1], plain[1])  # the 9-token request sees only its window


def test_engine_processes_get_the_patches():
    """A process with the CPU engine's environment (the stand-in first on PYTHONPATH) that imports SGLang's
    backend, sampler and scheduler -- before or after the stand-in, as SGLang's processes may -- runs the patched
    code, and SGLang's engine imports without flashinfer (nor the cutlass it pulls in)."""
    import subprocess
    import sys

    env = {**os.environ, **sglang_cpu.cpu_engine_env(1, base_env={})}
    check = ("import sglang.srt.layers.attention.torch_native_backend as b, sglang.srt.layers.sampler as s; "
             "assert b.TorchNativeAttnBackend._run_sdpa_forward_decode._rlhf_batched; "
             "assert getattr(b.TorchNativeAttnBackend._run_sdpa_forward_extend, '__name__') == "
             "'_run_sdpa_forward_extend' and 'batched_extend' in b.TorchNativeAttnBackend."
             "_run_sdpa_forward_extend.__code__.co_names; "
             "assert s.sampling_from_probs_torch._rlhf_inverse_cdf; "
             "import sys, sglang.srt.entrypoints.engine; "
             "assert not [n for n in sys.modules if n.split('.')[0] in ('flashinfer', 'cutlass')]; print('patched')")
    # the two import orders in two fresh processes at once (each imports SGLang's engine, one core apiece)
    firsts = ("import sgl_kernel; ", "import sglang.srt.layers.sampler; import sgl_kernel; ")
    procs = [subprocess.Popen([sys.executable, "-c", first + check], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for first in firsts]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for first, p, (stdout, stderr) in zip(firsts, procs, outs):
        assert p.returncode == 0 and stdout.strip().endswith("patched"), (first, stderr[-2000:])
