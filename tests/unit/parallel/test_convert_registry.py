"""Converter registry, safetensors I/O and the per-kind layout (fast, single process)."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from parallel.convert import (CONVERTERS, GATHER_DIM, HFCheckpointReader, ParamRole, UnsupportedModelError,
                                get_converter, hf_tensors_from_shards, local_shard_from_hf,
                                read_checkpoint_metadata, supported_architectures)
from parallel.convert.spec import HFModelSpec
from tests.support.hf_state import StateDictReader


def test_registry_lists_every_family_architecture():
    assert set(supported_architectures()) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                                              "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                                              "DeepseekV3ForCausalLM"}
    assert get_converter("Qwen2ForCausalLM") is CONVERTERS["LlamaForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        get_converter("GPT2LMHeadModel")


def test_every_map_entry_has_a_known_kind():
    for fam in {id(f): f for f in CONVERTERS.values()}.values():
        for key, (kind, names) in {**fam.top_map, **fam.layer_map}.items():
            assert kind in GATHER_DIM, (fam.name, key, kind)
            assert names and all(isinstance(n, str) for n in names)


def _write_sharded(tmp_path, tensors: dict, files: dict):
    """files: {file name: [tensor names]}; writes an index too."""
    for fname, names in files.items():
        save_file({n: tensors[n] for n in names}, str(tmp_path / fname))
    weight_map = {n: f for f, ns in files.items() for n in ns}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_metadata_and_slices_single_sharded_and_unindexed(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
               "c": torch.arange(10, dtype=torch.int64)}
    single = tmp_path / "single"
    single.mkdir()
    save_file(tensors, str(single / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    _write_sharded(sharded, tensors, {"model-00001-of-00002.safetensors": ["a"],
                                      "model-00002-of-00002.safetensors": ["b", "c"]})
    loose = tmp_path / "loose"  # two files, no index
    loose.mkdir()
    save_file({"a": tensors["a"]}, str(loose / "x.safetensors"))
    save_file({"b": tensors["b"], "c": tensors["c"]}, str(loose / "y.safetensors"))
    expect = {"a": ((6, 4), torch.float32), "b": ((3,), torch.bfloat16), "c": ((10,), torch.int64)}
    for d in (single, sharded, loose):
        assert read_checkpoint_metadata(str(d)) == expect
        with HFCheckpointReader(str(d)) as r:
            assert torch.equal(r.get("a", slice(2, 4)), tensors["a"][2:4])
            assert torch.equal(r.get("a", cols=slice(1, 3)), tensors["a"][:, 1:3])
            assert torch.equal(r.get("b"), tensors["b"]) and r.dtype("b") == torch.bfloat16
            with pytest.raises(KeyError, match="'zz' is missing"):
                r.get("zz")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        read_checkpoint_metadata(str(tmp_path))


def _spec(**kw):
    base = dict(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, ffn_hidden_size=12, num_layers=1,
                num_attention_heads=4, num_query_groups=2, head_dim=3, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=16, tie_word_embeddings=False, qkv_bias=False, moe_ffn_hidden_size=6)
    base.update(kw)
    return HFModelSpec(**base)


@pytest.mark.parametrize("kind,names,shapes,local", [
    ("qkv", ("q", "k", "v"), ((12, 8), (6, 8), (6, 8)), (12, 8)),  # head_dim 3 != hidden/heads
    ("qkv_bias", ("q", "k", "v"), ((12,), (6,), (6,)), (12,)),
    ("fc1", ("g", "u"), ((12, 8), (12, 8)), (12, 8)),
    ("expert_fc1", ("g", "u"), ((6, 8), (6, 8)), (6, 8)),
    ("row", ("o",), ((8, 12),), (8, 6)),
    ("expert_row", ("d",), ((8, 6),), (8, 3)),
    ("vocab", ("e",), ((10, 8),), (8, 8)),  # padded to 16 rows at tp 2
    ("replicated", ("n",), ((3,),), (3,)),
])
def test_layout_round_trip_at_tp2(kind, names, shapes, local):
    """local_shard_from_hf then hf_tensors_from_shards gives back the HF tensors bitwise."""
    spec = _spec()
    g = torch.Generator().manual_seed(1)
    hf = {n: torch.randn(*s, generator=g) for n, s in zip(names, shapes)}
    role = ParamRole(kind, names)
    tp = 1 if kind == "replicated" else 2
    shards = [local_shard_from_hf(StateDictReader(hf), role, torch.empty(local), spec, r, tp) for r in range(tp)]
    assert all(tuple(s.shape) == local for s in shards)
    back = dict(hf_tensors_from_shards(role, shards, spec))
    assert list(back) == list(names)
    for n in names:
        assert torch.equal(back[n], hf[n]), n
    if kind == "vocab":
        assert shards[1][2:].abs().max() == 0  # padded rows are zero
    if kind == "qkv":  # rank 0 holds group 0: q heads 0-1, then k head 0, then v head 0
        assert torch.equal(shards[0], torch.cat([hf["q"][:6], hf["k"][:3], hf["v"][:3]]))


def test_shape_mismatch_names_tensor():
    spec = _spec()
    hf = {"g": torch.zeros(5, 8), "u": torch.zeros(12, 8)}
    with pytest.raises(ValueError, match=r"'g' has shape \[5, 8\].*expected \[12, 8\]"):
        local_shard_from_hf(StateDictReader(hf), ParamRole("fc1", ("g", "u")), torch.empty(12, 8), spec, 0, 1)


def test_checkpoint_reader_needs_safetensors(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="convert .bin"):
        HFCheckpointReader(str(tmp_path / "empty"))


def _fake_chunk(layer_numbers, local_expert_indices):
    """The attributes param_role reads from a GPTModel chunk: layer_number and the MoE layer's experts."""
    from types import SimpleNamespace as NS

    mlp = NS(local_expert_indices=local_expert_indices, num_local_experts=len(local_expert_indices))
    return NS(decoder=NS(layers=[NS(layer_number=n, mlp=mlp) for n in layer_numbers]))


@pytest.mark.parametrize("arch,prefix,names", [
    ("Qwen3MoeForCausalLM", "mlp", ("experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj", "gate")),
    ("MixtralForCausalLM", "block_sparse_moe", ("experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2", "gate")),
])
def test_expert_names_are_global_for_sequential_and_grouped_layouts(arch, prefix, names):
    """Local expert i on EP rank r is global expert r * num_local + i (from the MoE layer), in both
    SequentialMLP (local_experts.<i>.) and TEGroupedMLP (weight<i>) names; layer indices are global."""
    from parallel.convert import param_role

    spec = _spec(architecture=arch, qkv_bias=False)
    chunk = _fake_chunk([7, 8], [4, 5, 6, 7])  # this rank holds layers 6-7 (PP) and experts 4-7 (EP rank 1)
    gate, up, down, router = (f"model.layers.7.{prefix}.{n}.weight" for n in names)
    role = param_role("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", chunk, spec)
    assert role == ParamRole("expert_fc1", (gate.format(e=6), up.format(e=6))) and role.is_expert
    role = param_role("decoder.layers.1.mlp.experts.linear_fc2.weight3", chunk, spec)
    assert role == ParamRole("expert_row", (down.format(e=7),))
    assert param_role("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", chunk, spec,
                      ep_rank=0).hf_names[0] == gate.format(e=2)
    assert param_role("decoder.layers.1.mlp.router.weight", chunk, spec) == ParamRole("replicated", (router,))
    with pytest.raises(KeyError, match="no Hugging Face mapping.*mlp.experts.local_experts.2.linear_fc3"):
        param_role("decoder.layers.1.mlp.experts.local_experts.2.linear_fc3.weight", chunk, spec)


def test_qwen3_q_k_norms_and_tied_output():
    from parallel.convert import param_role

    spec = _spec(architecture="Qwen3ForCausalLM", qk_norm=True, tie_word_embeddings=True)
    chunk = _fake_chunk([1], [])
    assert param_role("decoder.layers.0.self_attention.q_layernorm.weight", chunk, spec) == \
        ParamRole("replicated", ("model.layers.0.self_attn.q_norm.weight",))
    assert param_role("decoder.layers.0.self_attention.k_layernorm.weight", chunk, spec).hf_names == \
        ("model.layers.0.self_attn.k_norm.weight",)
    assert param_role("output_layer.weight", chunk, spec) == ParamRole("vocab", ("model.embed_tokens.weight",))
