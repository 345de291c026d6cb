"""Weight bridge, single process: golden layouts through SGLang's real weight loaders, bucketing,
validation before sending, persistent buffers, check mode.

The trainer side is simulated: Megatron-layout TP shards are built BY HAND from a random HF state
dict (per-group q/k/v interleave, [gate_r; up_r], vocab padded to 128 * tp) and put into tiny
modules carrying megatron's parameter names; `SimulatedTPTopology` hands the bridge all TP ranks'
shards, so its real plan -> gather -> `hf_tensors_from_shards` -> bucket -> serialized
FlattenedTensorBucket -> engine path runs without communication (tests/support/fakes.py: the engines deserialize the
payload bytes with SGLang's own SafeUnpickler and FlattenedTensorBucket).  The bridge's output is then fed to SGLang's real `QKVParallelLinear`,
`MergedColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` / `ParallelLMHead`
weight loaders under simulated rollout TP ranks (`get_parallel().override`) and compared (exactly)
with (a) the same loaders fed the original HF tensors and (b) an independently hand-built
per-rank layout.
"""
from __future__ import annotations

import re

import pytest
import torch

from rlhf.weight_bridge.bucketing import (BufferPool, TensorMeta, fill_buckets,
                                plan_buckets)
from parallel.model_config import HFModelSpec
from rlhf.weight_bridge import (WeightBridge, WeightBridgeError, WeightSyncConfig, regex_name_map,
                                 validate_against_expected)
from rlhf.rollout.manager import assert_plain_data
from tests.support.fakes import FakeEngines, SimulatedTPTopology, expected_weights_from_spec
from tests.support.hf_state import StateDictReader

# ----------------------------------------------------------------------------------------------
# model specs and a random HF state dict
# ----------------------------------------------------------------------------------------------
CASES = {
    # GQA 8 q heads / 4 kv heads, untied, no bias; rollout TP 8 > 4 kv heads replicates them
    "gqa": dict(heads=8, kv=4, tied=False, bias=False, trainer_tps=(1, 2, 4), rollout_tps=(1, 2, 4, 8)),
    # MHA
    "mha": dict(heads=4, kv=4, tied=False, bias=False, trainer_tps=(1, 2, 4), rollout_tps=(1, 2, 4)),
    # Qwen2-like: q/k/v bias, tied embeddings, GQA 4/2; rollout TP 4 > 2 kv heads
    "qwen2_tied_bias": dict(heads=4, kv=2, tied=True, bias=True, trainer_tps=(1, 2), rollout_tps=(1, 2, 4)),
    # untied with bias, kv replication at TP 2 and 4 (one kv head)
    "mqa_bias": dict(heads=4, kv=1, tied=False, bias=True, trainer_tps=(1,), rollout_tps=(1, 2, 4)),
}
H, D, FFN, VOCAB, LAYERS = 32, 8, 48, 1000, 2  # vocab 1000: not a multiple of 64


def make_spec(heads, kv, tied, bias, vocab=VOCAB, hidden=None, layers=LAYERS) -> HFModelSpec:
    hidden = hidden or heads * D
    return HFModelSpec(architecture="Qwen2ForCausalLM" if bias else "LlamaForCausalLM", vocab_size=vocab,
                       hidden_size=hidden, ffn_hidden_size=FFN, num_layers=layers, num_attention_heads=heads,
                       num_query_groups=kv, head_dim=D, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=128, tie_word_embeddings=tied, qkv_bias=bias)


def random_hf_state(spec: HFModelSpec, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, (shape, _) in expected_weights_from_spec(spec).items()}


# ----------------------------------------------------------------------------------------------
# hand-built megatron shards in tiny modules with megatron's names
# ----------------------------------------------------------------------------------------------
def pad_rows(t, rows):
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], 0)


def megatron_local_tensors(hf, spec: HFModelSpec, tp: int, r: int, divisible_by=128) -> dict[str, torch.Tensor]:
    """Megatron-core's TP-rank-r layout, written independently of parallel.convert."""
    d, G, nq = spec.head_dim, spec.num_query_groups, spec.num_attention_heads // spec.num_query_groups
    padded = -(-spec.vocab_size // (divisible_by * tp)) * divisible_by * tp
    per = padded // tp
    rows = slice(r * per, (r + 1) * per)
    out = {"embedding.word_embeddings.weight": pad_rows(hf["model.embed_tokens.weight"], padded)[rows].clone()}
    gpr, fpr = G // tp, spec.ffn_hidden_size // tp
    for i in range(spec.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (hf[p + f"self_attn.{x}_proj.{suffix}"] for x in "qkv")
            parts = []
            for g in range(r * gpr, (r + 1) * gpr):
                parts += [q[g * nq * d:(g + 1) * nq * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
            out[m + f"self_attention.linear_qkv.{suffix}"] = torch.cat(parts, 0).clone()
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        cols_q = spec.num_attention_heads * d // tp
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"][:, r * cols_q:(r + 1) * cols_q].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][r * fpr:(r + 1) * fpr],
                                                      hf[p + "mlp.up_proj.weight"][r * fpr:(r + 1) * fpr]], 0).clone()
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"][:, r * fpr:(r + 1) * fpr].clone()
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    head = hf["model.embed_tokens.weight"] if spec.tie_word_embeddings else hf["lm_head.weight"]
    # tied: the copy a last PP stage holds (the bridge must skip it)
    out["output_layer.weight"] = pad_rows(head, padded)[rows].clone()
    return out


class _Node(torch.nn.Module):
    pass


def fake_gpt(tensors: dict[str, torch.Tensor], buffers=(), layer_offset=0) -> torch.nn.Module:
    """A module tree whose state_dict names are megatron's; decoder.layers[i].layer_number set."""
    root = _Node()
    n_layers = 1 + max(int(m.group(1)) for n in tensors if (m := re.match(r"decoder\.layers\.(\d+)\.", n)))
    root.decoder = _Node()
    root.decoder.layers = torch.nn.ModuleList([_Node() for _ in range(n_layers)])
    for i, layer in enumerate(root.decoder.layers):
        layer.layer_number = layer_offset + i + 1
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part.isdigit():
                mod = mod[int(part)]
            else:
                if not hasattr(mod, part):
                    setattr(mod, part, _Node())
                mod = getattr(mod, part)
        if name in buffers:
            mod.register_buffer(leaf, t, persistent=True)
        else:
            mod.register_parameter(leaf, torch.nn.Parameter(t))
    return root


def simulated_trainer(hf, spec, tp, buffers=(), extra=None):
    ranks = []
    for r in range(tp):
        tensors = megatron_local_tensors(hf, spec, tp, r)
        tensors.update((extra or {}))
        ranks.append([fake_gpt(tensors, buffers)])
    return ranks


def run_bridge(hf, spec, tp, bucket_bytes=4096, engines=None, **kw):
    ranks = simulated_trainer(hf, spec, tp, kw.pop("buffers", ()), kw.pop("extra", None))
    engines = engines or FakeEngines(expected_weights_from_spec(spec))
    bridge = WeightBridge(ranks[0], spec, engines, WeightSyncConfig(bucket_bytes=bucket_bytes, **kw),
                          topology=SimulatedTPTopology(ranks))
    stats = bridge.sync()
    return engines.engines[0], stats


# ----------------------------------------------------------------------------------------------
# SGLang's loaders under simulated rollout TP ranks
# ----------------------------------------------------------------------------------------------
def sglang_rank_params(weights: dict[str, torch.Tensor], spec: HFModelSpec, tp: int, rank: int, layer: int = 0):
    """Per-rank fused parameters SGLang builds from HF-named `weights` (its real weight loaders)."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from sglang.srt.runtime_context import get_parallel

    p = f"model.layers.{layer}."
    Hs, NH, NKV, I, V = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, spec.ffn_hidden_size, spec.vocab_size
    with get_parallel().override(tp_size=tp, tp_rank=rank):
        qkv = QKVParallelLinear(Hs, spec.head_dim, NH, NKV, bias=spec.qkv_bias, params_dtype=torch.float32)
        for sid in "qkv":
            qkv.weight_loader(qkv.weight, weights[p + f"self_attn.{sid}_proj.weight"], sid)
            if spec.qkv_bias:
                qkv.weight_loader(qkv.bias, weights[p + f"self_attn.{sid}_proj.bias"], sid)
        gu = MergedColumnParallelLinear(Hs, [I, I], bias=False, params_dtype=torch.float32)
        gu.weight_loader(gu.weight, weights[p + "mlp.gate_proj.weight"], 0)
        gu.weight_loader(gu.weight, weights[p + "mlp.up_proj.weight"], 1)
        o = RowParallelLinear(NH * spec.head_dim, Hs, bias=False, params_dtype=torch.float32)
        o.weight_loader(o.weight, weights[p + "self_attn.o_proj.weight"])
        dn = RowParallelLinear(I, Hs, bias=False, params_dtype=torch.float32)
        dn.weight_loader(dn.weight, weights[p + "mlp.down_proj.weight"])
        em = VocabParallelEmbedding(V, Hs, params_dtype=torch.float32)
        em.weight_loader(em.weight, weights["model.embed_tokens.weight"])
        lm = ParallelLMHead(V, Hs, params_dtype=torch.float32)
        # tied: SGLang aliases lm_head to embed_tokens, i.e. the embedding's values
        lm.weight_loader(lm.weight, weights["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"])
    out = {"qkv_proj.weight": qkv.weight.data, "gate_up_proj.weight": gu.weight.data, "o_proj.weight": o.weight.data,
           "down_proj.weight": dn.weight.data, "embed_tokens.weight": em.weight.data, "lm_head.weight": lm.weight.data}
    if spec.qkv_bias:
        out["qkv_proj.bias"] = qkv.bias.data
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[n] = weights[p + n]  # replicated: default loader copies as is
    out["norm.weight"] = weights["model.norm.weight"]
    return out


def hand_expected(hf, spec: HFModelSpec, tp: int, r: int, layer: int = 0) -> dict[str, torch.Tensor]:
    """SGLang's per-rank layout written by hand (see shared/reference/README.md)."""
    p, d = f"model.layers.{layer}.", spec.head_dim
    NH, NKV, I, V = spec.num_attention_heads, spec.num_query_groups, spec.ffn_hidden_size, spec.vocab_size
    nh = NH // tp
    kv_heads = [r // (tp // NKV)] if tp >= NKV else list(range(r * (NKV // tp), (r + 1) * (NKV // tp)))
    out = {}
    for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
        q, k, v = (hf[p + f"self_attn.{x}_proj.{suffix}"] for x in "qkv")
        out[f"qkv_proj.{suffix}"] = torch.cat([q[r * nh * d:(r + 1) * nh * d]]
                                              + [k[h * d:(h + 1) * d] for h in kv_heads]
                                              + [v[h * d:(h + 1) * d] for h in kv_heads], 0)
    f = I // tp
    out["gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][r * f:(r + 1) * f],
                                            hf[p + "mlp.up_proj.weight"][r * f:(r + 1) * f]], 0)
    c = NH * d // tp
    out["o_proj.weight"] = hf[p + "self_attn.o_proj.weight"][:, r * c:(r + 1) * c]
    out["down_proj.weight"] = hf[p + "mlp.down_proj.weight"][:, r * f:(r + 1) * f]
    pad = 64 if (-(-V // 64) * 64) % tp == 0 else 64 * tp
    padded = -(-V // pad) * pad
    per = padded // tp
    for name, src in (("embed_tokens.weight", "model.embed_tokens.weight"),
                      ("lm_head.weight", "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight")):
        out[name] = pad_rows(hf[src], padded)[r * per:(r + 1) * per]
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[n] = hf[p + n]
    out["norm.weight"] = hf["model.norm.weight"]
    return out


# ----------------------------------------------------------------------------------------------
# golden layout tests
# ----------------------------------------------------------------------------------------------
GOLDEN = [(case, ttp) for case, c in CASES.items() for ttp in c["trainer_tps"]]


@pytest.mark.parametrize("case,trainer_tp", GOLDEN, ids=[f"{c}-trainer_tp{t}" for c, t in GOLDEN])
def test_golden_layout_through_sglang_loaders(case, trainer_tp):
    c = CASES[case]
    spec = make_spec(c["heads"], c["kv"], c["tied"], c["bias"])
    hf = random_hf_state(spec, seed=trainer_tp)
    sink, stats = run_bridge(hf, spec, trainer_tp, bucket_bytes=8192)
    sent = sink.received
    # what reaches the engine: exactly the HF state dict (tied: no lm_head)
    assert set(sent) == set(expected_weights_from_spec(spec))
    for name, t in hf.items():
        assert torch.equal(sent[name], t), name
    assert stats.num_buckets > 1
    for rtp in c["rollout_tps"]:
        for r in range(rtp):
            for layer in range(spec.num_layers):
                from_bridge = sglang_rank_params(sent, spec, rtp, r, layer)
                from_hf = sglang_rank_params(hf, spec, rtp, r, layer)
                expect = hand_expected(hf, spec, rtp, r, layer)
                assert set(from_bridge) == set(expect)
                for k in expect:
                    where = f"{case} trainer_tp={trainer_tp} rollout_tp={rtp} rank={r} layer={layer} {k}"
                    assert torch.equal(from_bridge[k], from_hf[k]), where
                    assert from_bridge[k].shape == expect[k].shape, (where, from_bridge[k].shape, expect[k].shape)
                    assert torch.equal(from_bridge[k], expect[k]), where


def test_hand_built_shards_match_hf_conversion_import():
    """The test's hand-built megatron layout agrees with hf_conversion.local_shard_from_hf."""
    from parallel.convert import ParamRole, local_shard_from_hf

    spec = make_spec(8, 4, False, True)
    hf = random_hf_state(spec)
    reader = StateDictReader(hf)
    for tp in (1, 2, 4):
        for r in range(tp):
            local = megatron_local_tensors(hf, spec, tp, r)
            qn = tuple(f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
            for name, role in [("decoder.layers.1.self_attention.linear_qkv.weight", ParamRole("qkv", qn)),
                               ("decoder.layers.1.mlp.linear_fc1.weight",
                                ParamRole("fc1", ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"))),
                               ("embedding.word_embeddings.weight", ParamRole("vocab", ("model.embed_tokens.weight",)))]:
                assert torch.equal(local_shard_from_hf(reader, role, local[name], spec, r, tp), local[name]), (tp, r, name)


# ----------------------------------------------------------------------------------------------
# bucketing
# ----------------------------------------------------------------------------------------------
def test_plan_buckets_sizes_order_and_alignment():
    metas = [TensorMeta(f"t{i}", (i + 1, 10), torch.float32) for i in range(20)]  # 40..800 bytes
    limit = 1000
    buckets = plan_buckets(metas, limit)
    flat = [m for b in buckets for m in b.metas]
    assert flat == metas  # every tensor exactly once, order kept
    for b in buckets:
        assert b.nbytes == sum(m.nbytes for m in b.metas) and b.offsets[0] == 0
        assert b.nbytes <= limit
    # greedy: adding the next bucket's first tensor would have overflowed
    for b, nxt in zip(buckets, buckets[1:]):
        assert b.nbytes + nxt.metas[0].nbytes > limit
    # oversize tensor alone; misaligned offsets start a new bucket
    big = plan_buckets([TensorMeta("a", (3,), torch.float32), TensorMeta("big", (100,), torch.float32),
                        TensorMeta("h", (3,), torch.bfloat16), TensorMeta("f", (2,), torch.float32)], 64)
    assert [b.names for b in big] == [["a"], ["big"], ["h"], ["f"]]
    mixed = plan_buckets([TensorMeta("h", (3,), torch.bfloat16), TensorMeta("f", (2,), torch.float32)], 1 << 20)
    assert [b.names for b in mixed] == [["h"], ["f"]]  # offset 6 is not a multiple of 4
    with pytest.raises(ValueError, match="twice"):
        plan_buckets([metas[0], metas[0]], limit)


def test_deepseek_q_a_and_kv_a_projections_share_a_bucket():
    """SGLang's DeepSeek loader fuses q_a_proj and kv_a_proj_with_mqa only when both come in one load_weights call
    (one bucket) and drops a lone half silently: the run q_a_proj .. kv_a_proj_with_mqa of a layer is never split,
    whatever the bucket size, while other tensors still split greedily."""
    f32 = torch.float32
    layer = lambda i: [TensorMeta(f"model.layers.{i}.input_layernorm.weight", (8,), f32),  # noqa: E731
                       TensorMeta(f"model.layers.{i}.self_attn.q_a_proj.weight", (6, 8), f32),
                       TensorMeta(f"model.layers.{i}.self_attn.q_a_layernorm.weight", (6,), f32),
                       TensorMeta(f"model.layers.{i}.self_attn.q_b_proj.weight", (16, 6), f32),
                       TensorMeta(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", (5, 8), f32),
                       TensorMeta(f"model.layers.{i}.self_attn.kv_a_layernorm.weight", (4,), f32)]
    metas = layer(0) + layer(1)
    for limit in (64, 200, 400, 700, 1000):  # the run is 192 + 24 + 384 + 160 = 760 bytes
        buckets = plan_buckets(metas, limit)
        assert [m for b in buckets for m in b.metas] == metas, limit
        for i in (0, 1):
            where = {n: k for k, b in enumerate(buckets) for n in b.names}
            run = [where[f"model.layers.{i}.self_attn.{t}.weight"]
                   for t in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa")]
            assert len(set(run)) == 1, (limit, [b.names for b in buckets])
        assert all(b.nbytes <= max(limit, 760) for b in buckets)
    # at a small limit the tensors outside the runs still fill buckets greedily around them
    sizes = [len(b.metas) for b in plan_buckets(metas, 64)]
    assert sizes == [1, 4, 2, 4, 1], sizes  # [ln0] [run0] [kv_a_layernorm0, ln1] [run1] [kv_a_layernorm1]


def test_bucket_layout_matches_sglang_flattened_bucket():
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("c", torch.randn(2, 2).to(torch.bfloat16))]
    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named]
    [plan] = plan_buckets(metas, 1 << 20)
    pool = BufferPool(1 << 20)
    [(bplan, slot, buf)] = list(fill_buckets(iter(named), [plan], pool))
    ref = FlattenedTensorBucket(named_tensors=named)
    assert torch.equal(buf, ref.get_flattened_tensor())
    rebuilt = FlattenedTensorBucket.empty([m.name for m in metas], [m.dtype for m in metas],
                                          [m.shape for m in metas], "cpu")
    rebuilt.get_flattened_tensor().copy_(buf)
    for (n, t), (n2, t2) in zip(named, rebuilt.reconstruct_tensors()):
        assert n == n2 and torch.equal(t, t2)
    pool.release(slot)


def test_fill_buckets_refuses_stream_out_of_plan():
    metas = [TensorMeta("a", (2,), torch.float32), TensorMeta("b", (2,), torch.float32)]
    plans = plan_buckets(metas, 8)
    assert len(plans) == 2

    def drain(stream):
        pool = BufferPool(8)
        for _plan, slot, _buf in fill_buckets(iter(stream), plans, pool):
            pool.release(slot)  # the consumer's duty; the pool has a single buffer

    with pytest.raises(ValueError, match="out of plan"):
        drain([("a", torch.zeros(2)), ("x", torch.zeros(2))])
    with pytest.raises(ValueError, match="out of plan"):
        drain([("a", torch.zeros(2)), ("b", torch.zeros(3))])
    with pytest.raises(ValueError, match="ended before"):
        drain([("a", torch.zeros(2))])
    with pytest.raises(ValueError, match="not in the send plan"):
        drain([("a", torch.zeros(2)), ("b", torch.zeros(2)), ("c", torch.zeros(2))])
    drain([("a", torch.zeros(2)), ("b", torch.zeros(2))])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bucket_bytes", [1, 5000, 40000, 1 << 30])
def test_bridge_buckets_each_tensor_once_and_bounds_memory(bucket_bytes, overlap):
    spec = make_spec(8, 4, False, True)
    hf = random_hf_state(spec, seed=3)
    sink, stats = run_bridge(hf, spec, 2, bucket_bytes=bucket_bytes, overlap=overlap)
    updates = [names for call, names in sink.calls if call == "update_weights_from_tensor"]
    sent = [n for names in updates for n in names]
    assert sorted(sent) == sorted(hf) and len(sent) == len(set(sent))  # each tensor exactly once
    assert stats.num_buckets == len(updates) and stats.bytes == sum(t.nbytes for t in hf.values())
    for names in updates:
        nbytes = sum(hf[n].nbytes for n in names)
        assert nbytes <= bucket_bytes or len(names) == 1  # only a single oversize tensor may exceed
    # one cache flush per sync, by the last update call (no separate flush request)
    assert sink.flushes == 1
    # peak extra memory: bucket buffer(s) + one gathered megatron parameter (padded vocab) and its
    # converted HF copy -- never the model (here several times one bucket)
    biggest_param = max(t.nbytes for t in hf.values())
    biggest_gathered = max(2 * t.nbytes for t in megatron_local_tensors(hf, spec, 2, 0).values())
    bucket = max(min(bucket_bytes, stats.bytes), biggest_param)
    n_buffers = 2 if overlap else 1
    assert stats.peak_extra_bytes <= n_buffers * bucket + biggest_gathered + biggest_param


def test_peak_memory_is_a_small_part_of_the_model():
    spec = make_spec(8, 4, False, True, vocab=128, layers=6)  # layers dominate, 40 KB bucket ~ 1/15 of it
    hf = random_hf_state(spec, seed=4)
    sink, stats = run_bridge(hf, spec, 2, bucket_bytes=40000)
    biggest_gathered = max(2 * t.nbytes for t in megatron_local_tensors(hf, spec, 2, 0).values())
    assert stats.peak_extra_bytes <= 40000 + 2 * biggest_gathered
    assert stats.peak_extra_bytes < stats.bytes / 4, (stats.peak_extra_bytes, stats.bytes)
    for n, t in hf.items():
        assert torch.equal(sink.received[n], t)


def test_bridge_casts_to_engine_dtype():
    spec = make_spec(4, 2, True, True)
    hf = random_hf_state(spec)
    sink, _ = run_bridge(hf, spec, 2, engines=FakeEngines(expected_weights_from_spec(spec, torch.bfloat16)))
    for n, t in hf.items():
        assert sink.received[n].dtype == torch.bfloat16 and torch.equal(sink.received[n], t.to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# validation before sending
# ----------------------------------------------------------------------------------------------
def _refused(spec, hf, expected, match):
    engines = FakeEngines(expected, n=2)
    with pytest.raises(WeightBridgeError, match=match) as ei:
        run_bridge(hf, spec, 2, engines=engines)
    assert engines.log == ["expected_weights"]  # nothing opened, nothing sent
    assert all(e.received == {} for e in engines.engines)
    return str(ei.value)


def test_wrong_shape_refused_before_sending():
    spec = make_spec(8, 4, False, False)
    hf = random_hf_state(spec)
    exp = expected_weights_from_spec(spec)
    exp["model.layers.1.self_attn.k_proj.weight"] = ((16, spec.hidden_size), torch.float32)
    msg = _refused(spec, hf, exp, "k_proj")
    assert "(32, 64)" in msg and "(16, 64)" in msg and "refused before sending" in msg


def test_unknown_name_refused_before_sending():
    spec = make_spec(8, 4, False, False)
    hf = random_hf_state(spec)
    exp = expected_weights_from_spec(spec)
    exp["model.layers.0.self_attn.qkv_proj.weight"] = exp.pop("model.layers.0.self_attn.q_proj.weight")
    msg = _refused(spec, hf, exp, "q_proj")
    assert "is not a weight of the rollout engines" in msg and "stale" in msg  # unknown q_proj + unfilled qkv_proj


def test_missing_engine_weight_refused_but_tied_lm_head_allowed():
    spec = make_spec(8, 4, False, False)
    hf = random_hf_state(spec)
    exp = expected_weights_from_spec(spec)
    exp["model.layers.0.mlp.extra.weight"] = ((3, 3), torch.float32)
    _refused(spec, hf, exp, r"mlp\.extra\.weight.*stale")
    # a tied model's engine may list lm_head.weight (aliased to embed_tokens): not required
    tied = make_spec(4, 2, True, True)
    exp = expected_weights_from_spec(tied)
    exp["lm_head.weight"] = ((VOCAB, tied.hidden_size), torch.float32)
    sink, _ = run_bridge(random_hf_state(tied), tied, 2, engines=FakeEngines(exp))
    assert "lm_head.weight" not in sink.received and "model.embed_tokens.weight" in sink.received


def test_validate_against_expected_reports_duplicates_across_stages():
    spec = make_spec(4, 2, True, False)
    exp = {"model.norm.weight": expected_weights_from_spec(spec)["model.norm.weight"]}  # nothing else expected
    stages = {0: [("model.norm.weight", (32,), "float32")], 1: [("model.norm.weight", (32,), "float32")]}
    problems = validate_against_expected(stages, exp, spec.tie_word_embeddings)
    assert len(problems) == 1 and "sent twice" in problems[0]


# ----------------------------------------------------------------------------------------------
# persistent buffers, name-map hook
# ----------------------------------------------------------------------------------------------
def test_persistent_buffer_under_standard_name_is_sent():
    """A frozen final norm kept as a persistent buffer under its usual megatron name."""
    spec = make_spec(4, 2, False, False)
    hf = random_hf_state(spec)
    sink, stats = run_bridge(hf, spec, 2, buffers={"decoder.final_layernorm.weight"})
    assert torch.equal(sink.received["model.norm.weight"], hf["model.norm.weight"]) and not stats.skipped_buffers


def test_name_map_hook_maps_custom_buffer_and_unmapped_ones_are_skipped():
    spec = make_spec(4, 2, False, False)
    hf = random_hf_state(spec)
    gain = torch.rand(spec.hidden_size) + 0.5
    ranks = []
    for r in range(2):
        t = megatron_local_tensors(hf, spec, 2, r)
        del t["decoder.final_layernorm.weight"]  # the norm gain lives in a custom buffer instead
        t["decoder.final_layernorm.ema_gain"] = gain.clone()
        t["decoder.layers.1.self_attention.step_count"] = torch.tensor([7.0])  # no HF counterpart
        ranks.append([fake_gpt(t, buffers={"decoder.final_layernorm.ema_gain",
                                           "decoder.layers.1.self_attention.step_count"})])
    engines = FakeEngines(expected_weights_from_spec(spec))
    name_map = regex_name_map({r"decoder\.final_layernorm\.ema_gain": ("replicated", "model.norm.weight")})
    stats = WeightBridge(ranks[0], spec, engines, WeightSyncConfig(name_map=name_map),
                         topology=SimulatedTPTopology(ranks)).sync()
    assert torch.equal(engines.engines[0].received["model.norm.weight"], gain)
    assert stats.skipped_buffers == ["chunk0.decoder.layers.1.self_attention.step_count"]
    # without the hook the engine's model.norm.weight is unfilled: refused
    engines2 = FakeEngines(expected_weights_from_spec(spec))
    with pytest.raises(WeightBridgeError, match=r"model\.norm\.weight.*stale"):
        WeightBridge(ranks[0], spec, engines2, topology=SimulatedTPTopology(ranks)).sync()
    # a layer-indexed rule: {layer} is the global layer index
    nm = regex_name_map({r"decoder\.layers\.(?P<i>\d+)\.self_attention\.step_count":
                         ("replicated", "model.layers.{layer}.self_attn.step_count")})
    role = nm(ranks[0][0], "decoder.layers.1.self_attention.step_count", None)
    assert role.kind == "replicated" and role.hf_names == ("model.layers.1.self_attn.step_count",)


def test_unmapped_parameter_is_an_error():
    spec = make_spec(4, 2, False, False)
    hf = random_hf_state(spec)
    with pytest.raises(WeightBridgeError, match="mystery.*no Hugging Face name"):
        run_bridge(hf, spec, 1, extra={"decoder.layers.0.mlp.mystery": torch.zeros(3)})


# ----------------------------------------------------------------------------------------------
# check mode
# ----------------------------------------------------------------------------------------------
def test_check_mode_verifies_and_detects_corruption():
    spec = make_spec(8, 4, False, True)
    hf = random_hf_state(spec)
    sink, stats = run_bridge(hf, spec, 2, check="all")
    assert len(stats.check.verified) == len(hf) and not stats.check.mismatched
    corrupt = FakeEngines(expected_weights_from_spec(spec),
                          corrupt=lambda n, t: t + 1 if n.endswith("down_proj.weight") else t)
    with pytest.raises(WeightBridgeError, match="down_proj"):
        run_bridge(hf, spec, 2, check="sample", engines=corrupt)


def test_several_engines_get_the_same_weights_or_none_does():
    spec = make_spec(8, 4, False, True)
    hf = random_hf_state(spec, seed=5)
    ranks = simulated_trainer(hf, spec, 2)
    engines = FakeEngines(expected_weights_from_spec(spec), n=2, tp_size=2)
    WeightBridge(ranks[0], spec, engines, WeightSyncConfig(bucket_bytes=10000), topology=SimulatedTPTopology(ranks)).sync()
    for n, t in hf.items():
        assert all(torch.equal(e.received[n], t) for e in engines.engines)
    assert [e.flushes for e in engines.engines] == [1, 1]
    # the engines disagree with the trainer on a shape: all refused before anything is sent
    bad = expected_weights_from_spec(spec)
    bad["model.norm.weight"] = ((7,), torch.float32)
    engines = FakeEngines(bad, n=2)
    with pytest.raises(WeightBridgeError, match=r"'model.norm.weight'.*\(64,\) but the rollout engines expect"):
        WeightBridge(ranks[0], spec, engines, topology=SimulatedTPTopology(ranks)).sync()
    assert engines.log == ["expected_weights"] and all(e.received == {} for e in engines.engines)


def test_engines_handle_only_on_the_controller_and_only_bytes_cross():
    spec = make_spec(4, 2, False, False)
    ranks = simulated_trainer(random_hf_state(spec), spec, 1)
    with pytest.raises(ValueError, match="global rank 0"):
        WeightBridge(ranks[0], spec, None, topology=SimulatedTPTopology(ranks))
    with pytest.raises(ValueError, match="transport"):
        WeightSyncConfig(transport="nccl")
    # the engines' handle refuses tensors on the weight path (they would be pickled through Ray)
    with pytest.raises(TypeError, match="torch.Tensor"):
        assert_plain_data("update_weights_from_tensor", (), {}, [{"serialized_named_tensors": [torch.zeros(2)]}])
    assert_plain_data("update_weights_from_tensor", (), {"flush_cache": True}, [{"serialized_named_tensors": [b"x"]}])


def test_engine_replaced_mid_sync_stays_stale_and_gets_every_tensor_on_resync():
    """Engine 1 dies at its 3rd bucket of a multi-bucket sync: the sync completes for engine 0, engine 1 is
    stale; the next sync of engine 1 alone brings it exactly the latest weights (every tensor compared)."""
    spec = make_spec(8, 4, False, True)
    hf = random_hf_state(spec, seed=6)
    ranks = simulated_trainer(hf, spec, 2)
    engines = FakeEngines(expected_weights_from_spec(spec), n=2, kill_at=[(1, 2)])
    bridge = WeightBridge(ranks[0], spec, engines, WeightSyncConfig(bucket_bytes=5000), topology=SimulatedTPTopology(ranks))
    stats = bridge.sync()
    assert stats.num_buckets > 3 and stats.engines == [0] and engines.stale_engines() == [1]
    assert all(torch.equal(engines.engines[0].received[n], t) for n, t in hf.items())
    assert len(engines.engines[1].received) < len(hf)  # the fresh engine got nothing of this sync
    stats = bridge.sync(engines=engines.stale_engines())
    assert stats.engines == [1] and engines.stale_engines() == [] and stats.replanned  # restart: re-validated
    assert set(engines.engines[1].received) == set(hf)
    assert all(torch.equal(engines.engines[1].received[n], t) for n, t in hf.items())
    assert engines.engines[1].flushes == 1


def test_plan_is_checked_by_fingerprint_and_reused():
    spec = make_spec(4, 2, False, False)
    hf = random_hf_state(spec, seed=7)
    ranks = simulated_trainer(hf, spec, 2)
    engines = FakeEngines(expected_weights_from_spec(spec))
    bridge = WeightBridge(ranks[0], spec, engines, topology=SimulatedTPTopology(ranks))
    assert bridge.sync().replanned and not bridge.sync().replanned
    assert engines.log.count("expected_weights") == 1
    engines.restarts[0] += 1  # a changed engine: planned and validated again before sending
    engines.expected["model.norm.weight"] = ((5,), torch.float32)
    with pytest.raises(WeightBridgeError, match="model.norm.weight"):
        bridge.sync()


def test_fill_buckets_writes_parts_as_the_concatenated_tensors_and_one_receive_buffer():
    """A stream of HFTensorParts (the sync's conversion straight into the bucket) fills bitwise the buckets a stream
    of the concatenated tensors fills, cast to the planned dtype, an oversize bucket (one tensor above the pool's
    buffers) included.  The pool's receive buffer (BufferPool.scratch) is one buffer, grown to the largest request,
    metered, and freed with the pool."""
    from parallel.convert import ParamRole, hf_tensors_from_shards
    from parallel.convert.shard_regions import hf_parts_from_shards
    from rlhf.weight_bridge.bucketing import MemoryMeter

    g = torch.Generator().manual_seed(3)
    row, fc1 = ParamRole("row", ("o",)), ParamRole("fc1", ("gate", "up"))
    rs, fs = [torch.randn(4, 3, generator=g) for _ in range(2)], [torch.randn(4, 3, generator=g) for _ in range(2)]
    tensors = hf_tensors_from_shards(row, rs, None) + hf_tensors_from_shards(fc1, fs, None)
    parts = hf_parts_from_shards(row, rs, None) + hf_parts_from_shards(fc1, fs, None)
    plans = plan_buckets([TensorMeta(n, tuple(t.shape), torch.bfloat16) for n, t in tensors], 40)
    assert [b.names for b in plans] == [["o"], ["gate"], ["up"]] and plans[0].nbytes > 40  # "o" is oversize

    def buckets(stream):
        pool, out = BufferPool(40), []
        for _plan, slot, buf in fill_buckets(iter(stream), plans, pool):
            out.append(buf.clone())
            pool.release(slot)
        return out

    want, got = buckets(tensors), buckets(parts)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(want[0].view(torch.bfloat16).view(4, 6), torch.cat(rs, 1).to(torch.bfloat16))
    meter = MemoryMeter()
    pool = BufferPool(8, meter=meter)
    a, b = pool.scratch(100, torch.empty(0)), pool.scratch(50, torch.empty(0))
    assert b.data_ptr() == a.data_ptr() and b.numel() == 50 and meter.current == 100
    assert pool.scratch(200, torch.empty(0)).numel() == 200 and meter.current == 200 == meter.peak
    pool.close()
    assert meter.current == 0
