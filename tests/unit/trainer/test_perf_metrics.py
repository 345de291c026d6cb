"""verl's perf/mfu/* and perf/max_memory_allocated_gb (rlhf/trainer/perf.py): the FLOPs estimate hand-computed
from verl's formulas (verl/utils/flops_counter.py: _estimate_qwen2_flops, _estimate_qwen2_moe_flops,
_estimate_deepseek_v3_flops) on tiny configs, the device peak table, a device without a known peak."""
from __future__ import annotations

import logging

import pytest
import torch

from parallel.convert.spec import HFModelSpec
from rlhf.trainer import perf
from rlhf.trainer.perf import PerfMeter, device_peak_flops, update_flops

# vocab 10, hidden 4, ffn 8, 1 layer, 2 heads of 2, 1 KV group
TINY_SPEC = HFModelSpec(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, ffn_hidden_size=8, num_layers=1,
                        num_attention_heads=2, num_query_groups=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                        max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False)


def _spec(**kw):
    import dataclasses

    return dataclasses.replace(TINY_SPEC, **kw)


def test_dense_flops_as_verl_qwen2_estimate():
    # verl: attn_linear_N = H (q + k + v + heads d) = 4 (4 + 2 + 2 + 4) = 48; mlp_N = 3 H I = 96; emb + head 2 V H = 80
    # -> N = 224; 6 N tokens (8) + 6 sum(s^2) (9 + 25) d heads L = 10752 + 816
    assert update_flops(TINY_SPEC, [3, 5]) == 6 * 224 * 8 + 6 * 34 * 2 * 2 * 1 == 11568


def test_moe_flops_as_verl_qwen2_moe_estimate():
    # moe_mlp_N = H topk I_moe 3 + H E = 4 * 2 * 3 * 3 + 4 * 4 = 88; N = 88 + 48 + 80 = 216
    spec = _spec(num_experts=4, moe_topk=2, moe_ffn_hidden_size=3)
    assert update_flops(spec, [3, 5]) == 6 * 216 * 8 + 816


def test_mla_moe_flops_as_verl_deepseek_v3_estimate():
    """2 layers, the first dense (first_k_dense_replace=1), one shared expert; MLA without q LoRA: kv_lora_rank 4,
    qk_nope 2, qk_rope 1, v 2 (q_head_dim 3)."""
    spec = _spec(num_layers=2, num_experts=4, moe_topk=2, moe_ffn_hidden_size=3, moe_shared_ffn_hidden_size=3,
                 moe_dense_layers=1, extra={"megatron": {"multi_latent_attention": True, "q_lora_rank": None,
                                                         "kv_lora_rank": 4, "qk_head_dim": 2,
                                                         "qk_pos_emb_head_dim": 1, "v_head_dim": 2}})
    attn = 4 * 2 * 3 + 4 * (4 + 1) + 2 * (3 - 1 + 2) * 4 + 2 * 2 * 4  # 24 + 20 + 32 + 16 = 92
    moe_layer = 4 * 4 + 4 * 3 * (2 + 1) * 3 + attn  # gate H E + experts H I_moe (topk + shared) 3 = 16 + 108
    dense_layer = 3 * 4 * 8 + attn
    n = moe_layer + dense_layer + 80
    assert n == 484
    assert update_flops(spec, [3, 5]) == 6 * n * 8 + 3 * 34 * (3 + 2) * 2 * 2


def test_device_peaks_follow_verls_table():
    assert device_peak_flops(torch.device("cpu")) == 448e9  # verl's declared CPU figure
    assert device_peak_flops(torch.device("cuda", 0), name="NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops(torch.device("cuda", 0), name="NVIDIA L40S") == 362.05e12  # not L40's
    assert device_peak_flops(torch.device("cuda", 0), name="Mystery GPU") is None
    assert device_peak_flops(torch.device("cuda", 0), name="NVIDIA A40") == 149.7e12
    assert device_peak_flops(torch.device("cuda", 0), name="NVIDIA RTX A4000") is None  # was A40's peak
    assert device_peak_flops(torch.device("meta")) is None and PerfMeter({}, "meta", 1, {}).memory({}) == {}


def test_mfu_hand_computed_and_an_unknown_peak_is_left_out_with_one_line(caplog):
    batch = {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])}  # 2 3 3 3 2
    meter = PerfMeter({"actor": TINY_SPEC, "critic": TINY_SPEC}, "cpu", 2, {"actor": 2, "critic": 1},
                      peak_flops=1e3)
    flops = update_flops(TINY_SPEC, [2, 3, 3, 3, 2])
    got = meter.mfu({"timing_s/update_actor": 4.0, "timing_s/update_critic": 2.0}, batch)
    assert got == pytest.approx({"perf/mfu/actor": flops * 2 / (4.0 * 1e3 * 2), "perf/mfu/critic": flops / (2e3 * 2)})
    assert meter.mfu({"timing_s/update_critic": 2.0}, batch).keys() == {"perf/mfu/critic"}  # critic warm-up step
    unknown = PerfMeter({"actor": TINY_SPEC}, "cpu", 1, {})
    unknown.peak = None  # as for a GPU missing from the table
    with caplog.at_level(logging.WARNING, logger=perf.__name__):
        assert unknown.mfu({"timing_s/update_actor": 1.0}, batch) == {}
        assert unknown.mfu({"timing_s/update_actor": 1.0}, batch) == {}
    assert [r.getMessage()[:40] for r in caplog.records] == ["perf/mfu/* not logged: the peak FLOP/s o"]


def test_peak_memory_on_cpu_is_the_process_peak_rss():
    import resource

    got = PerfMeter({}, "cpu", 1, {}).memory({})
    assert set(got) == {"perf/max_memory_allocated_gb"}
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / (1 << 30)
    assert got["perf/max_memory_allocated_gb"] == pytest.approx(rss_gb, rel=0.05) and rss_gb > 0.05


def test_peak_memory_on_cuda_is_the_running_max_of_the_phases(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2 << 30)
    meter = PerfMeter({}, torch.device("cuda", 0), 1, {}, peak_flops=1.0)
    step1 = meter.memory({"memory/gen/max_allocated_gb": 3.0, "memory/gen/max_reserved_gb": 4.0})
    assert step1 == {"perf/max_memory_allocated_gb": 3.0, "perf/max_memory_reserved_gb": 4.0}
    step2 = meter.memory({"memory/gen/max_allocated_gb": 0.5})  # the process peak so far, as verl's
    assert step2 == {"perf/max_memory_allocated_gb": 3.0, "perf/max_memory_reserved_gb": 4.0}
