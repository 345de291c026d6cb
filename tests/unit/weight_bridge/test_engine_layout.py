"""The engine-layout plan, single process: SGLang's real layers and load_weights under simulated engine TP ranks.

A small model of SGLang's real parallel layers (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding / ParallelLMHead, ReplicatedLinear routers, FusedMoE experts, plain norms incl. Qwen3's q/k
norms) with the families' parameter names is loaded by the real ``LlamaForCausalLM._legacy_load_weights`` /
``Qwen2ForCausalLM._legacy_load_weights`` / ``Qwen3ForCausalLM.load_weights`` / ``Qwen3MoeForCausalLM.load_weights``
/ ``MixtralForCausalLM.load_weights`` (what the CPU engine runs), in a runtime context of SGLang's own.  The layout is probed from it
(engine_probe.probe_layout), the plan is composed against megatron shards at trainer TP 1 / TP 2 / PP 2 (shards
cut from the HF tensors by the converter's import, ``local_shard_from_hf``), every trainer rank writes its blocks
into the shared sections, the engine's loader copies each parameter once -- and every engine parameter must equal
(bitwise) what SGLang's own loading of the HF tensors gives.
"""
from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch

from parallel.convert.layout import ParamRole, local_shard_from_hf
from parallel.convert.params import LocalTensor
from rlhf.rollout import engine_loader
from rlhf.rollout.engine_loader import LayoutProbeError, copy_bucket, engine_params, keep_mapped, probe_layout
from rlhf.rollout.engine_probe import split_layer
from rlhf.weight_bridge.engine_layout import (DirectPlan, LayoutUnavailable, agree, build_direct_plan, compose_writes,
                                              layout_from_probes, shard_runs, write_section_ops)
from rlhf.weight_bridge.shared_params import ArenaMaps, arena_plan
from tests.support.hf_state import StateDictReader
from tests.unit.weight_bridge.test_weight_bridge_layout import make_spec, random_hf_state

FAMILIES = {"llama_untied_gqa": dict(heads=8, kv=4, tied=False, bias=False),
            "qwen2_tied_bias": dict(heads=4, kv=2, tied=True, bias=True),
            "qwen3_qk_norm": dict(heads=4, kv=2, tied=True, bias=False, qk_norm=True, hidden=48),
            "qwen3_moe": dict(heads=4, kv=2, tied=False, bias=False, qk_norm=True, hidden=48, moe="qwen3"),
            "mixtral": dict(heads=4, kv=2, tied=False, bias=False, moe="mixtral")}
EXPERTS, MOE_FFN = 4, 16
#: HF names of a MoE layer's router and expert e's gate / up / down projections
MOE_NAMES = {"qwen3": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                       "mlp.experts.{e}.down_proj.weight"),
             "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                         "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")}
TRAINERS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
GRID = [(f, t, etp) for f in FAMILIES for t in TRAINERS for etp in (1, 2)]


def family_spec(name, layers=3):
    c = dict(FAMILIES[name])
    qk_norm, hidden = c.pop("qk_norm", False), c.pop("hidden", None)
    spec = make_spec(c["heads"], c["kv"], c["tied"], c["bias"], hidden=hidden, layers=layers)
    if qk_norm:
        spec.architecture, spec.qk_norm = "Qwen3ForCausalLM", True
    if c.get("moe"):
        spec.architecture = {"qwen3": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[c["moe"]]
        spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size = EXPERTS, 2, MOE_FFN
    return spec


def family_hf(name, spec, seed):
    """A random HF state dict of ``spec`` (q/k norms and MoE experts included)."""
    hf = random_hf_state(spec, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    moe = FAMILIES[name].get("moe")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        if spec.qk_norm:
            for x in "qk":
                hf[p + f"self_attn.{x}_norm.weight"] = torch.randn(spec.head_dim, generator=g)
        if moe:
            for n in ("gate_proj", "up_proj", "down_proj"):
                del hf[p + f"mlp.{n}.weight"]
            gate, *experts = MOE_NAMES[moe]
            hf[p + gate] = torch.randn(EXPERTS, spec.hidden_size, generator=g)
            for e in range(EXPERTS):
                for n, shape in zip(experts, ((MOE_FFN, spec.hidden_size),) * 2 + ((spec.hidden_size, MOE_FFN),)):
                    hf[p + n.format(e=e)] = torch.randn(shape, generator=g)
    return hf


@pytest.fixture(scope="module")
def sglang_context(tmp_path_factory):
    """A runtime context of SGLang's own (its FusedMoE reads the engine's config bags), used instead of the
    process's: ServerArgs of a config-only Qwen3-MoE directory, CPU."""
    import transformers
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    path = str(tmp_path_factory.mktemp("sglang_cfg"))
    transformers.Qwen3MoeConfig(vocab_size=1000, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=3, moe_intermediate_size=MOE_FFN, num_experts=EXPERTS,
                                num_experts_per_tok=2, head_dim=8,
                                architectures=["Qwen3MoeForCausalLM"]).save_pretrained(path)
    return create_context(ServerArgs(model_path=path, device="cpu", skip_tokenizer_init=True), role="scheduler")


@contextlib.contextmanager
def engine_rank(ctx, tp: int, rank: int):
    """Engine TP rank ``rank`` of ``tp`` (attention and MoE TP alike, no expert parallelism) in ``ctx``."""
    from sglang.srt.runtime_context import get_parallel, use_context

    with use_context(ctx), get_parallel().override(tp_size=tp, tp_rank=rank, attn_tp_size=tp, attn_tp_rank=rank,
                                                   moe_tp_size=tp, moe_tp_rank=rank, moe_ep_size=1, moe_ep_rank=0):
        yield


class _Node(torch.nn.Module):
    pass


def _norm(n):
    m = _Node()
    m.weight = torch.nn.Parameter(torch.zeros(n))
    return m


def sglang_model(ctx, spec, tp: int, rank: int, seed: int = 99):
    """SGLang's real layers under engine TP rank ``rank`` of ``tp``, named like its Llama/Qwen2/Qwen3/Qwen3-MoE/
    Mixtral models (FusedMoE experts), with the model class's own load_weights bound; parameters start random
    (stale weights)."""
    from sglang.srt.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                          RowParallelLinear)
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.mixtral import MixtralForCausalLM
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    H, I = spec.hidden_size, spec.ffn_hidden_size
    moe = {"Qwen3MoeForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral"}.get(spec.architecture)
    with engine_rank(ctx, tp, rank):
        root = _Node()
        root.config = SimpleNamespace(tie_word_embeddings=spec.tie_word_embeddings, num_experts=EXPERTS,
                                      num_local_experts=EXPERTS)
        root.pp_group = SimpleNamespace(is_last_rank=True)
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
            if spec.qk_norm:
                layer.self_attn.q_norm, layer.self_attn.k_norm = _norm(spec.head_dim), _norm(spec.head_dim)
            if moe:
                block = _Node()
                block.gate = ReplicatedLinear(H, EXPERTS, bias=False, params_dtype=torch.float32)
                block.experts = FusedMoE(num_experts=EXPERTS, top_k=2, hidden_size=H, intermediate_size=MOE_FFN,
                                         layer_id=len(root.model.layers), params_dtype=torch.float32)
                setattr(layer, "mlp" if moe == "qwen3" else "block_sparse_moe", block)
            else:
                layer.mlp = _Node()
                layer.mlp.gate_up_proj = MergedColumnParallelLinear(H, [I, I], bias=False, params_dtype=torch.float32)
                layer.mlp.down_proj = RowParallelLinear(I, H, bias=False, params_dtype=torch.float32)
            layer.input_layernorm, layer.post_attention_layernorm = _norm(H), _norm(H)
            root.model.layers.append(layer)
        root.model.norm = _norm(H)
        root.lm_head = (root.model.embed_tokens if spec.tie_word_embeddings
                        else ParallelLMHead(spec.vocab_size, H, params_dtype=torch.float32))
    if moe:
        root.load_weights = (Qwen3MoeForCausalLM if moe == "qwen3" else MixtralForCausalLM).load_weights.__get__(root)
    elif spec.qk_norm:
        root.load_weights = Qwen3ForCausalLM.load_weights.__get__(root)
    else:
        cls = Qwen2ForCausalLM if spec.qkv_bias else LlamaForCausalLM
        root.load_weights = cls._legacy_load_weights.__get__(root)
    g = torch.Generator().manual_seed(seed + rank)
    with torch.no_grad():
        for p in root.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return root


def trainer_entries(hf, spec, tp: int, r: int, layers: range, first: bool, last: bool) -> list[LocalTensor]:
    """TP rank r's megatron shards of ``layers`` (plus the embedding on the first stage, the final norm and an untied
    output layer on the last) as LocalTensors, cut by the converter's import from the HF tensors."""
    H, d, G, NH = spec.hidden_size, spec.head_dim, spec.num_query_groups, spec.num_attention_heads
    padded = -(-spec.vocab_size // (128 * tp)) * 128 * tp
    roles = []
    if first:
        roles.append(("embedding.word_embeddings.weight", ParamRole("vocab", ("model.embed_tokens.weight",)),
                      (padded // tp, H)))
    for i in layers:
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")
        roles.append((m + "self_attention.linear_qkv.weight", ParamRole("qkv", qkv), ((NH + 2 * G) * d // tp, H)))
        if spec.qkv_bias:
            roles.append((m + "self_attention.linear_qkv.bias",
                          ParamRole("qkv_bias", tuple(n.replace("weight", "bias") for n in qkv)),
                          ((NH + 2 * G) * d // tp,)))
        if spec.qk_norm:
            for x in "qk":
                roles.append((m + f"self_attention.{x}_layernorm.weight",
                              ParamRole("replicated", (p + f"self_attn.{x}_norm.weight",)), (d,)))
        roles += [(m + "input_layernorm.weight", ParamRole("replicated", (p + "input_layernorm.weight",)), (H,)),
                  (m + "self_attention.linear_proj.weight", ParamRole("row", (p + "self_attn.o_proj.weight",)),
                   (H, NH * d // tp)),
                  (m + "pre_mlp_layernorm.weight", ParamRole("replicated", (p + "post_attention_layernorm.weight",)),
                   (H,)),
                  ]
        if spec.num_experts:
            gate, fc_gate, fc_up, fc_down = MOE_NAMES["qwen3" if "Qwen3" in spec.architecture else "mixtral"]
            roles.append((m + "mlp.router.weight", ParamRole("replicated", (p + gate,)), (EXPERTS, H)))
            for e in range(EXPERTS):
                x = m + f"mlp.experts.local_experts.{e}."
                roles += [(x + "linear_fc1.weight", ParamRole("expert_fc1", (p + fc_gate.format(e=e),
                                                                              p + fc_up.format(e=e))),
                           (2 * MOE_FFN // tp, H)),
                          (x + "linear_fc2.weight", ParamRole("expert_row", (p + fc_down.format(e=e),)),
                           (H, MOE_FFN // tp))]
        else:
            roles += [(m + "mlp.linear_fc1.weight",
                       ParamRole("fc1", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                       (2 * spec.ffn_hidden_size // tp, H)),
                      (m + "mlp.linear_fc2.weight", ParamRole("row", (p + "mlp.down_proj.weight",)),
                       (H, spec.ffn_hidden_size // tp))]
    if last:
        roles.append(("decoder.final_layernorm.weight", ParamRole("replicated", ("model.norm.weight",)), (H,)))
        if not spec.tie_word_embeddings:
            roles.append(("output_layer.weight", ParamRole("vocab", ("lm_head.weight",)), (padded // tp, H)))
    reader = StateDictReader(hf)
    return [LocalTensor(0, None, name, local_shard_from_hf(reader, role, torch.empty(shape), spec, r, tp).contiguous(),
                        role, True) for name, role, shape in roles]


def trainer_ranks(hf, spec, tp: int, pp: int):
    """``[(pp rank, tp rank, entries)]`` of a simulated trainer (layers split evenly over the stages)."""
    per = spec.num_layers // pp + (spec.num_layers % pp > 0)
    out = []
    for s in range(pp):
        layers = range(s * per, min((s + 1) * per, spec.num_layers))
        for r in range(tp):
            out.append((s, r, trainer_entries(hf, spec, tp, r, layers, s == 0, s == pp - 1)))
    return out


def probe_all(ctx, spec, hf, etp, **kw):
    probes = []
    for r in range(etp):
        model = sglang_model(ctx, spec, etp, r)
        with engine_rank(ctx, etp, r):
            probes.append(probe_layout(model, [(n, tuple(t.shape)) for n, t in hf.items()], r, etp, **kw))
    return probes


def generic_params(ctx, spec, hf, etp, r):
    """Rank r's parameters after SGLang's own loading of the HF tensors (the reference)."""
    model = sglang_model(ctx, spec, etp, r, seed=5)
    with engine_rank(ctx, etp, r):
        model.load_weights(list(hf.items()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def stage_sends(ranks, pp):
    """The generic plan's ``[(pp rank, leader, {HF name: dtype})]`` of a simulated trainer (leader = pp rank)."""
    return [(s, s, {n: torch.float32 for pr, _, ents in ranks if pr == s for e in ents for n in e.role.hf_names})
            for s in range(pp)]


@pytest.mark.parametrize("family,trainer,engine_tp", GRID, ids=[f"{f}-{t}-etp{e}" for f, t, e in GRID])
def test_engine_layout_writes_equal_sglang_loading(sglang_context, family, trainer, engine_tp):
    ctx = sglang_context
    spec = family_spec(family)
    tp, pp = TRAINERS[trainer]
    hf = family_hf(family, spec, seed=tp + 10 * engine_tp + 100 * pp)
    layout = layout_from_probes(probe_all(ctx, spec, hf, engine_tp))
    assert layout.tp_size == engine_tp
    assert len(layout.templates) == 2  # the tensors outside the layers, and one map every layer reuses
    ranks = trainer_ranks(hf, spec, tp, pp)
    plan = build_direct_plan(layout, stage_sends(ranks, pp), bucket_bytes=engine_tp * 16384)
    assert len(plan.send.stages) == pp and len(plan.buckets) > pp
    composed = [(s, compose_writes(plan, ents, spec, r, tp, s)) for s, r, ents in ranks]
    assert agree(plan, [(None, cov) for _, (_, cov) in composed]) is None
    # one copy program per bucket and engine parameter section (strided blocks, not per row)
    assert max(len(blocks) for _, (ops, _) in composed for k in ops for *_, blocks in k) <= 4
    buffers = {}
    for s in range(pp):
        for k, bucket in enumerate(plan.send.stages[s].buckets):
            buf = torch.full((plan.buffer_bytes(bucket),), 0xAB, dtype=torch.uint8)
            for (stage, (ops, _)), (_, _, ents) in zip(composed, ranks):  # each rank writes its own elements
                if stage == s:
                    write_section_ops(ops[k], buf, plan.stride(bucket), [e.tensor.view(-1) for e in ents])
            buffers[id(bucket)] = buf
    for r in range(engine_tp):
        model = sglang_model(ctx, spec, engine_tp, r, seed=3)
        params = engine_params(model)
        for bucket in plan.buckets:
            section = buffers[id(bucket)][r * plan.stride(bucket):r * plan.stride(bucket) + bucket.nbytes]
            copy_bucket(params, section, json.loads(plan.header(bucket))["params"])
        want = generic_params(ctx, spec, hf, engine_tp, r)
        assert set(want) == set(params)
        for n, p in params.items():
            assert torch.equal(p.detach(), want[n]), f"{family} {trainer} engine rank {r}/{engine_tp}: {n}"


@pytest.mark.parametrize("family,trainer,engine_tp", [("qwen3_moe", "tp2", 2), ("llama_untied_gqa", "pp2", 2),
                                                     ("qwen2_tied_bias", "tp1", 1)])
def test_zero_copy_writes_into_shared_parameters_equal_sglang_loading(sglang_context, family, trainer, engine_tp):
    """The engines' parameters moved into shared arenas (engine_loader.share_parameters), the trainer ranks' ops
    written straight into them through their own mappings (shared_params.ArenaMaps), then committed: every
    parameter bitwise SGLang's own loading; a parameter SGLang moved out of the arena gets the written bytes."""
    ctx = sglang_context
    spec = family_spec(family)
    tp, pp = TRAINERS[trainer]
    hf = family_hf(family, spec, seed=5)
    layout = layout_from_probes(probe_all(ctx, spec, hf, engine_tp))
    ranks = trainer_ranks(hf, spec, tp, pp)
    plan = build_direct_plan(layout, stage_sends(ranks, pp), bucket_bytes=1 << 20)
    models = [sglang_model(ctx, spec, engine_tp, r, seed=3) for r in range(engine_tp)]
    share = {"fingerprint": layout.fingerprint,
             "ranks": [engine_loader.share_parameters(m, engine_params(m)) for m in models]}
    zplan = arena_plan(plan, [share])
    assert zplan.arenas is not None and [len(s.buckets) for s in zplan.send.stages] == [1] * pp
    moved_name = "model.layers.1.self_attn.o_proj.weight"
    params = [engine_params(m) for m in models]
    params[-1][moved_name].data = params[-1][moved_name].data.clone()  # SGLang replaced this storage
    for s, r, ents in ranks:
        ops, _ = compose_writes(zplan, ents, spec, r, tp, s)
        maps = ArenaMaps()
        maps.open(zplan)
        maps.write(ops, ents, [0])
        maps.close()
    moved = [engine_loader.commit_shared(m, p) for m, p in zip(models, params)]
    assert moved == [[]] * (engine_tp - 1) + [[moved_name]]
    for r, p in enumerate(params):
        want = generic_params(ctx, spec, hf, engine_tp, r)
        assert all(torch.equal(p[n].detach(), want[n]) for n in want), f"engine rank {r}"


def test_probe_records_fused_and_padded_layout(sglang_context):
    """The probe reads SGLang's own rules back: q/k/v stacked, gate/up merged, the vocabulary padded with zeros."""
    spec = family_spec("llama_untied_gqa")
    hf = random_hf_state(spec)
    layout = layout_from_probes(probe_all(sglang_context, spec, hf, 2))
    layer_t = layout.templates[layout.groups[1][1]]
    assert [g for g, _ in layout.groups] == [None, 0, 1, 2] and len({t for _, t in layout.groups[1:]}) == 1
    slot = {n: i for i, (n, _) in enumerate(layer_t.hf)}
    qkv = [m.name for m in layer_t.params].index("model.layers.{L}.self_attn.qkv_proj.weight")
    d, H = spec.head_dim, spec.hidden_size
    # rank 1 of 2: q heads 4..7, then kv heads 2..3 of k and of v, each one contiguous run of full rows
    assert layer_t.runs[1][qkv].tolist() == [
        [0, slot["model.layers.{L}.self_attn.q_proj.weight"], 4 * d * H, 4 * d * H],
        [4 * d * H, slot["model.layers.{L}.self_attn.k_proj.weight"], 2 * d * H, 2 * d * H],
        [6 * d * H, slot["model.layers.{L}.self_attn.v_proj.weight"], 2 * d * H, 2 * d * H]]
    top = layout.templates[layout.groups[0][1]]
    emb = top.runs[1][[m.name for m in top.params].index("model.embed_tokens.weight")]
    assert emb[-1, 1].item() == -1 and emb[-1, 3].item() > 0  # padded rows of the last shard: zeros
    assert "lm_head.weight" in [m.name for m in top.params]


def test_probe_holds_one_group_and_checks_reused_layers(sglang_context):
    """While the loaders run, only the current group's parameters are real tensors (the rest are one shared
    element, expanded): never a copy of the whole model.  A layer whose loader maps differently than the first
    layer of its shape gets its own map instead of the first one's."""
    spec = family_spec("llama_untied_gqa", layers=4)
    hf = random_hf_state(spec)
    model = sglang_model(sglang_context, spec, 1, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    real, held = model.load_weights, []

    def watched(weights):
        weights = list(weights)
        group = {split_layer(n)[0] for n, _ in weights}
        held.append(({split_layer(n)[0] for n, p in model.named_parameters() if p.data.untyped_storage().nbytes() > 8},
                     group))
        if any(".layers.2." in n for n, _ in weights):  # layer 2's loader swaps gate and up
            weights = [(n.replace("gate_proj", "X").replace("up_proj", "gate_proj").replace("X", "up_proj"), t)
                       for n, t in weights]
        return real(weights)

    probe = probe_layout(model, [(n, tuple(t.shape)) for n, t in hf.items()], 0, 1, load_weights=watched)
    assert len(held) == 5 + 2 + 1  # one call per group, a reversed one per new map (incl. layer 2's)
    assert all(real_groups == group and len(group) == 1 for real_groups, group in held)
    assert [t for _, t in probe["groups"]] == [0, 1, 1, 2, 1]  # layer 2 probed on its own
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n].detach(), before[n]) and after[n].dtype == torch.float32 for n in before)


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_probe_is_the_same_in_small_batches_and_chunks(sglang_context, monkeypatch, engine_tp):
    """HF indices handed to the loaders in several calls per group, parameters decoded in small chunks: the same
    maps (rows split over chunks, runs joined across them)."""
    from rlhf.rollout import engine_probe

    spec = family_spec("qwen2_tied_bias", layers=2)
    hf = family_hf("qwen2_tied_bias", spec, seed=4)
    want = probe_all(sglang_context, spec, hf, engine_tp)
    monkeypatch.setattr(engine_probe, "_BATCH", 700)
    monkeypatch.setattr(engine_probe, "_CHUNK", 37)
    got = probe_all(sglang_context, spec, hf, engine_tp)
    for w, g in zip(want, got):
        assert w["groups"] == g["groups"] and len(w["templates"]) == len(g["templates"]) == 2
        for tw, tg in zip(w["templates"], g["templates"]):
            assert tw["hf"] == tg["hf"]
            assert [(n, s, d) for n, s, d, _ in tw["params"]] == [(n, s, d) for n, s, d, _ in tg["params"]]
            assert all(torch.equal(a[3], b[3]) for a, b in zip(tw["params"], tg["params"]))


def test_probe_refuses_loaders_that_change_values(sglang_context):
    spec = family_spec("llama_untied_gqa", layers=1)
    hf = random_hf_state(spec)
    model = sglang_model(sglang_context, spec, 1, 0)
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


def test_probe_refuses_a_model_that_derives_tensors_after_loading(sglang_context):
    """SGLang's DeepSeek-V3 computes its absorbed MLA matrices from kv_b_proj in post_load_weights: a copy into the
    parameters leaves them stale (the engine's log-probs 2.3 nats off the trainer's after one sync through zero
    copy in a PPO run), so the engine-layout paths are refused and SGLang's own loading runs."""
    spec = family_spec("llama_untied_gqa", layers=1)
    hf = random_hf_state(spec)
    model = sglang_model(sglang_context, spec, 1, 0)
    model.post_load_weights = lambda *a, **k: None
    with pytest.raises(LayoutProbeError, match="post_load_weights"):
        probe_layout(model, [(n, tuple(t.shape)) for n, t in hf.items()], 0, 1)


def test_probe_refuses_a_partly_loaded_parameter_and_a_write_outside_the_layer(sglang_context):
    spec = family_spec("llama_untied_gqa", layers=2)
    hf = random_hf_state(spec)
    model = sglang_model(sglang_context, spec, 1, 0)
    names = [(n, tuple(t.shape)) for n, t in hf.items() if "v_proj" not in n]  # the qkv parameter's v rows stay
    with pytest.raises(LayoutProbeError, match="qkv_proj.*only part"):
        probe_layout(model, names, 0, 1)
    real = model.load_weights

    def crossing(weights):  # layer 1's norm lands in layer 0's parameter
        return real([(n.replace("layers.1.input_layernorm", "layers.0.input_layernorm"), t) for n, t in weights])

    with pytest.raises((LayoutProbeError, RuntimeError), match="another layer|more than one element"):
        probe_layout(model, [(n, tuple(t.shape)) for n, t in hf.items()], 0, 1, load_weights=crossing)


def test_shard_runs_read_the_converter_without_data():
    """Megatron's interleaved q/k/v shard of TP rank 1: group-sized runs of q, then k, then v rows."""
    spec = family_spec("llama_untied_gqa")
    d, H, nq = spec.head_dim, spec.hidden_size, spec.num_attention_heads // spec.num_query_groups
    role = ParamRole("qkv", ("q", "k", "v"))
    shape = ((nq + 2) * d * spec.num_query_groups // 2, H)
    q = shard_runs(role, shape, "q", (spec.num_attention_heads * d, H), spec, 1, 2)
    k = shard_runs(role, shape, "k", (spec.num_query_groups * d, H), spec, 1, 2)
    per = (nq + 2) * d * H  # one query group's rows in the shard
    assert q.tolist() == [[(2 + g) * nq * d * H, g * per, nq * d * H] for g in range(2)]
    assert k.tolist() == [[(2 + g) * d * H, g * per + nq * d * H, d * H] for g in range(2)]
    down = shard_runs(ParamRole("row", ("w",)), (H, 8), "w", (H, 16), spec, 1, 2)
    assert down.shape == (H, 3) and down[1].tolist() == [16 + 8, 8, 8]  # row 1, columns 8..15


def test_loader_refuses_a_bucket_for_another_layout_and_copies_nothing(sglang_context, monkeypatch):
    spec = family_spec("llama_untied_gqa", layers=1)
    model = sglang_model(sglang_context, spec, 2, 1)
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


def test_bucket_mappings_are_kept_across_syncs_and_dropped_when_unused():
    torch.multiprocessing.set_sharing_strategy("file_system")
    a, b = (torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(4096)) for _ in range(2))
    engine_loader._HELD.clear()
    keep_mapped(a, last=False)
    keep_mapped(b, last=True)
    assert set(engine_loader._HELD) == {a.data_ptr(), b.data_ptr()}
    keep_mapped(b, last=True)  # a sync that used only b
    assert set(engine_loader._HELD) == {b.data_ptr()}
    keep_mapped(torch.zeros(8), last=True)  # not shared memory: never held
    assert not engine_loader._HELD


def test_plan_refuses_unsent_recast_split_over_stages_and_uncovered_writes(sglang_context):
    spec = family_spec("llama_untied_gqa", layers=2)
    hf = random_hf_state(spec)
    layout = layout_from_probes(probe_all(sglang_context, spec, hf, 1))
    sent = {n: torch.float32 for n in hf}
    with pytest.raises(LayoutUnavailable, match="does not send"):
        build_direct_plan(layout, [(0, 0, {n: d for n, d in sent.items() if n != "model.norm.weight"})], 1 << 20)
    with pytest.raises(LayoutUnavailable, match="sent as torch.bfloat16"):
        build_direct_plan(layout, [(0, 0, dict(sent, **{"lm_head.weight": torch.bfloat16}))], 1 << 20)
    up = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(LayoutUnavailable, match="gate_up_proj.*stages \\[0, 1\\]"):
        build_direct_plan(layout, [(0, 0, {n: d for n, d in sent.items() if n != up}), (1, 1, {up: torch.float32})],
                          1 << 20)
    plan = build_direct_plan(layout, [(0, 0, sent)], 1 << 20)
    assert isinstance(plan, DirectPlan)
    assert "cover" in agree(plan, [(None, plan.expected_elements - 1)])
    assert agree(plan, [("rank 1: boom", 0), (None, plan.expected_elements)]) == "rank 1: boom"
    with pytest.raises(LayoutUnavailable, match="rank 1"):
        layout_from_probes([{"error": "x", "tp_rank": 1, "tp_size": 2}])
