"""The engine-layout plan, single process: SGLang's real layers and load_weights under simulated engine TP ranks.

A small model of SGLang's real parallel layers (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding / ParallelLMHead) with Llama's or Qwen2's parameter names is loaded by the real
``LlamaForCausalLM._legacy_load_weights`` / ``Qwen2ForCausalLM._legacy_load_weights`` (what the CPU engine runs).
The layout is probed from it (engine_loader.probe_layout), the plan is composed against hand-built megatron shards
at trainer TP 1 and 2 (tests/unit/weight_bridge/test_weight_bridge_layout.py), every trainer rank writes its
blocks into the shared sections, the engine's loader copies each parameter once -- and every engine parameter
must equal (bitwise) what SGLang's own loading of the HF tensors gives.
"""
from __future__ import annotations

import json

import pytest
import torch

from rlhf.rollout import engine_loader
from rlhf.rollout.engine_loader import LayoutProbeError, copy_bucket, engine_params, probe_layout
from rlhf.weight_bridge.engine_layout import (DirectPlan, LayoutUnavailable, agree, build_direct_plan, compose_writes,
                                              layout_from_probes, write_section_ops)
from rlhf.weight_bridge.plan import local_entries
from tests.unit.weight_bridge.test_weight_bridge_layout import (fake_gpt, make_spec, megatron_local_tensors,
                                                                random_hf_state)

CASES = {"llama_untied_gqa": dict(heads=8, kv=4, tied=False, bias=False),
         "qwen2_tied_bias": dict(heads=4, kv=2, tied=True, bias=True)}
GRID = [(c, ttp, etp) for c in CASES for ttp in (1, 2) for etp in (1, 2)]


class _Node(torch.nn.Module):
    pass


def _norm(hidden):
    m = _Node()
    m.weight = torch.nn.Parameter(torch.zeros(hidden))
    return m


def sglang_model(spec, tp: int, rank: int, seed: int = 99):
    """SGLang's real layers under engine TP rank ``rank`` of ``tp``, named like its Llama/Qwen2 models, with the
    model class's own load_weights bound; parameters start random (stale weights)."""
    from types import SimpleNamespace

    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.runtime_context import get_parallel

    H, I = spec.hidden_size, spec.ffn_hidden_size
    with get_parallel().override(tp_size=tp, tp_rank=rank):
        root = _Node()
        root.config = SimpleNamespace(tie_word_embeddings=spec.tie_word_embeddings)
        root.model = _Node()
        root.model.embed_tokens = VocabParallelEmbedding(spec.vocab_size, H, params_dtype=torch.float32)
        root.model.layers = torch.nn.ModuleList()
        for _ in range(spec.num_layers):
            layer = _Node()
            layer.self_attn = _Node()
            layer.self_attn.qkv_proj = QKVParallelLinear(H, spec.head_dim, spec.num_attention_heads,
                                                         spec.num_query_groups, bias=spec.qkv_bias,
                                                         params_dtype=torch.float32)
            layer.self_attn.o_proj = RowParallelLinear(spec.num_attention_heads * spec.head_dim, H, bias=False,
                                                       params_dtype=torch.float32)
            layer.mlp = _Node()
            layer.mlp.gate_up_proj = MergedColumnParallelLinear(H, [I, I], bias=False, params_dtype=torch.float32)
            layer.mlp.down_proj = RowParallelLinear(I, H, bias=False, params_dtype=torch.float32)
            layer.input_layernorm, layer.post_attention_layernorm = _norm(H), _norm(H)
            root.model.layers.append(layer)
        root.model.norm = _norm(H)
        root.lm_head = (root.model.embed_tokens if spec.tie_word_embeddings
                        else ParallelLMHead(spec.vocab_size, H, params_dtype=torch.float32))
    cls = Qwen2ForCausalLM if spec.qkv_bias else LlamaForCausalLM
    root.load_weights = cls._legacy_load_weights.__get__(root)
    g = torch.Generator().manual_seed(seed + rank)
    with torch.no_grad():
        for p in root.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return root


def probe_all(spec, hf, etp):
    from sglang.srt.runtime_context import get_parallel

    probes = []
    for r in range(etp):
        model = sglang_model(spec, etp, r)
        with get_parallel().override(tp_size=etp, tp_rank=r):
            probes.append(probe_layout(model, [(n, tuple(t.shape)) for n, t in hf.items()], r, etp))
    return probes


def generic_params(spec, hf, etp, r):
    """Rank r's parameters after SGLang's own loading of the HF tensors (the reference)."""
    from sglang.srt.runtime_context import get_parallel

    model = sglang_model(spec, etp, r, seed=5)
    with get_parallel().override(tp_size=etp, tp_rank=r):
        model.load_weights(list(hf.items()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case,trainer_tp,engine_tp", GRID, ids=[f"{c}-ttp{t}-etp{e}" for c, t, e in GRID])
def test_engine_layout_writes_equal_sglang_loading(case, trainer_tp, engine_tp):
    c = CASES[case]
    spec = make_spec(c["heads"], c["kv"], c["tied"], c["bias"])
    hf = random_hf_state(spec, seed=trainer_tp + 10 * engine_tp)
    layout = layout_from_probes(probe_all(spec, hf, engine_tp))
    assert layout.tp_size == engine_tp
    plan = build_direct_plan(layout, {n: torch.float32 for n in hf}, bucket_bytes=engine_tp * 16384)
    assert len(plan.buckets) > 1
    ranks = [local_entries([fake_gpt(megatron_local_tensors(hf, spec, trainer_tp, t))], spec)[0]
             for t in range(trainer_tp)]
    composed = [compose_writes(plan, ranks[t], spec, t, trainer_tp) for t in range(trainer_tp)]
    assert agree(plan, [(None, cov) for _, cov in composed]) is None
    # one copy program per bucket and engine parameter section (strided blocks, not per row)
    assert max(len(blocks) for ops, _ in composed for k in ops for *_, blocks in k) <= 4
    buffers = []
    for k, bucket in enumerate(plan.buckets):
        buf = torch.full((plan.buffer_bytes(bucket),), 0xAB, dtype=torch.uint8)
        for t, (ops, _) in enumerate(composed):  # the trainer ranks write their own elements, in any order
            write_section_ops(ops[k], buf, plan.stride(bucket), [e.tensor.detach().view(-1) for e in ranks[t]])
        buffers.append(buf)
    for r in range(engine_tp):
        model = sglang_model(spec, engine_tp, r, seed=3)
        params = engine_params(model)
        for bucket, buf in zip(plan.buckets, buffers):
            section = buf[r * plan.stride(bucket):r * plan.stride(bucket) + bucket.nbytes]
            copy_bucket(params, section, json.loads(plan.header(bucket))["params"])
        want = generic_params(spec, hf, engine_tp, r)
        assert set(want) == set(params)
        for n, p in params.items():
            assert torch.equal(p.detach(), want[n]), f"{case} trainer_tp={trainer_tp} engine rank {r}/{engine_tp}: {n}"


def test_probe_records_fused_and_padded_layout():
    """The probe reads SGLang's own rules back: q/k/v stacked, gate/up merged, the vocabulary padded with zeros."""
    spec = make_spec(8, 4, False, False)
    hf = random_hf_state(spec)
    probes = probe_all(spec, hf, 2)
    layout = layout_from_probes(probes)
    runs = layout.runs[1]["model.layers.0.self_attn.qkv_proj.weight"]
    base = {n: b for n, (_, b) in layout.hf.items()}
    d, H = spec.head_dim, spec.hidden_size
    # rank 1 of 2: q heads 4..7, then kv heads 2..3 of k and of v, each one contiguous run of full rows
    assert runs.tolist() == [[0, base["model.layers.0.self_attn.q_proj.weight"] + 4 * d * H, 4 * d * H],
                             [4 * d * H, base["model.layers.0.self_attn.k_proj.weight"] + 2 * d * H, 2 * d * H],
                             [6 * d * H, base["model.layers.0.self_attn.v_proj.weight"] + 2 * d * H, 2 * d * H]]
    emb = layout.runs[1]["model.embed_tokens.weight"]
    assert emb[-1, 1].item() == -1 and emb[-1, 2].item() > 0  # padded rows of the last shard: zeros
    assert "lm_head.weight" in layout.runs[0]


def test_probe_refuses_loaders_that_change_values():
    spec = make_spec(4, 2, False, False, layers=1)
    hf = random_hf_state(spec)
    model = sglang_model(spec, 1, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = [(n, tuple(t.shape)) for n, t in hf.items()]
    for change in (lambda t: t * 2, lambda t: t + 1):
        real = model.load_weights

        def scaled(weights, real=real, change=change):
            return real([(n, change(t) if "o_proj" in n else t) for n, t in weights])

        with pytest.raises(LayoutProbeError, match="o_proj.*changes values"):
            probe_layout(model, names, 0, 1, load_weights=scaled)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n].detach(), before[n]) for n in before)  # weights restored


def test_probe_refuses_a_partly_loaded_parameter():
    spec = make_spec(4, 2, False, False, layers=1)
    hf = random_hf_state(spec)
    model = sglang_model(spec, 1, 0)
    names = [(n, tuple(t.shape)) for n, t in hf.items() if "v_proj" not in n]  # the qkv parameter's v rows stay
    with pytest.raises(LayoutProbeError, match="qkv_proj.*only part"):
        probe_layout(model, names, 0, 1)


def test_loader_refuses_a_bucket_for_another_layout_and_copies_nothing(monkeypatch):
    spec = make_spec(4, 2, False, False, layers=1)
    hf = random_hf_state(spec)
    model = sglang_model(spec, 2, 1)
    monkeypatch.setattr(engine_loader, "_tp", lambda: (1, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    name = "model.norm.weight"
    flat = torch.zeros(spec.hidden_size * 4, dtype=torch.uint8)
    wrong = engine_loader.param_signature(engine_params(model), 0, 2)  # rank 0's signature
    header = json.dumps({"op": "load", "signatures": [wrong, wrong], "params": [[name, 0]]})
    with pytest.raises(ValueError, match="refused, nothing copied"):
        engine_loader.load(model, [(header, flat)])
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    right = engine_loader.param_signature(engine_params(model), 1, 2)
    engine_loader.load(model, [(json.dumps({"op": "load", "signatures": [wrong, right], "params": [[name, 0]]}), flat)])
    assert torch.equal(dict(model.named_parameters())[name].detach(), torch.zeros(spec.hidden_size))
    del hf


def test_plan_refuses_unsent_or_recast_tensors_and_uncovered_writes():
    spec = make_spec(4, 2, False, False, layers=1)
    hf = random_hf_state(spec)
    layout = layout_from_probes(probe_all(spec, hf, 1))
    sent = {n: torch.float32 for n in hf}
    with pytest.raises(LayoutUnavailable, match="does not send"):
        build_direct_plan(layout, {n: d for n, d in sent.items() if n != "model.norm.weight"}, 1 << 20)
    with pytest.raises(LayoutUnavailable, match="sent as torch.bfloat16"):
        build_direct_plan(layout, dict(sent, **{"lm_head.weight": torch.bfloat16}), 1 << 20)
    plan = build_direct_plan(layout, sent, 1 << 20)
    assert isinstance(plan, DirectPlan)
    assert "cover" in agree(plan, [(None, plan.expected_elements - 1)])
    assert agree(plan, [("rank 1: boom", 0), (None, plan.expected_elements)]) == "rank 1: boom"
    with pytest.raises(LayoutUnavailable, match="rank 1"):
        layout_from_probes([{"error": "x", "tp_rank": 1, "tp_size": 2}])
