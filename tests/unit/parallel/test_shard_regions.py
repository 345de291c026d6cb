"""Each TP rank's regions of the HF tensors (parallel.convert.shard_regions), assembled from every rank,
equal the gather-then-convert result (layout.hf_tensors_from_shards) exactly, for every kind."""
import pytest
import torch

from parallel.convert import ParamRole, hf_tensors_from_shards
from parallel.convert.shard_regions import hf_parts_from_shards, shard_regions
from parallel.model_config import HFModelSpec

SPEC = HFModelSpec(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=32, ffn_hidden_size=48,
                   num_layers=1, num_attention_heads=8, num_query_groups=4, head_dim=4, rms_norm_eps=1e-6,
                   rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True)
QKV = ("q", "k", "v")


def shards_for(kind, tp, g):
    H, d, G, nq = SPEC.hidden_size, SPEC.head_dim, SPEC.num_query_groups, 2
    if kind == "replicated":
        return [torch.randn(H, generator=g)] * tp
    if kind == "vocab":
        per = -(-SPEC.vocab_size // (128 * tp)) * 128
        shards = [torch.randn(per, H, generator=g) for _ in range(tp)]
        for r, s in enumerate(shards):  # megatron pads with zero rows
            s[max(0, SPEC.vocab_size - r * per):] = 0
        return shards
    if kind == "row":
        return [torch.randn(H, 32 // tp, generator=g) for _ in range(tp)]
    if kind == "column":
        return [torch.randn(24 // tp, H, generator=g) for _ in range(tp)]
    if kind in ("fc1", "shared_fc1"):
        return [torch.randn(2 * 48 // tp, H, generator=g) for _ in range(tp)]
    if kind == "qkv":
        return [torch.randn(G // tp * (nq + 2) * d, H, generator=g) for _ in range(tp)]
    if kind == "qkv_bias":
        return [torch.randn(G // tp * (nq + 2) * d, generator=g) for _ in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind,names", [("replicated", ("n",)), ("vocab", ("e",)), ("row", ("o",)),
                                        ("fc1", ("gate", "up")), ("shared_fc1", ("gate", "up")),
                                        ("column", ("q_b",)), ("qkv", QKV), ("qkv_bias", QKV)])
def test_regions_of_all_ranks_rebuild_the_hf_tensors(kind, names, tp):
    g = torch.Generator().manual_seed(tp)
    shards = shards_for(kind, tp, g)
    role = ParamRole(kind, names)
    want = dict(hf_tensors_from_shards(role, shards if kind != "replicated" else shards[:1], SPEC))
    got = {n: torch.full_like(t, float("nan")) for n, t in want.items()}
    for r in range(tp):
        for reg in shard_regions(role, shards[r], SPEC, r, tp):
            reg.write(got[reg.name])
    for n in want:
        assert torch.equal(got[n], want[n]), (kind, tp, n)  # every element written once (no NaN left)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind,names", [("replicated", ("n",)), ("vocab", ("e",)), ("row", ("o",)),
                                        ("fc1", ("gate", "up")), ("qkv", QKV), ("qkv_bias", QKV)])
def test_parts_write_bitwise_what_concatenation_then_copy_gives(kind, names, tp, dtype):
    """The weight sync's conversion straight into a bucket (hf_parts_from_shards, each part's write into a view of
    the planned dtype) gives bitwise the bytes of gather -> hf_tensors_from_shards -> copy_ into the bucket (the
    path before), names, shapes and dtypes included."""
    shards = shards_for(kind, tp, torch.Generator().manual_seed(7 + tp))
    shards = shards if kind != "replicated" else shards[:1]
    role = ParamRole(kind, names)
    want = hf_tensors_from_shards(role, shards, SPEC)
    parts = hf_parts_from_shards(role, shards, SPEC)
    assert [(n, tuple(p.shape), p.dtype) for n, p in parts] == [(n, tuple(t.shape), t.dtype) for n, t in want]
    for (name, t), (_, p) in zip(want, parts):
        ref, got = torch.empty(t.shape, dtype=dtype).copy_(t), torch.full(t.shape, float("nan"), dtype=dtype)
        p.write(got)
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), name  # bitwise (a NaN left fails)


def test_regions_cast_on_write_and_unknown_kind():
    role = ParamRole("row", ("o",))
    shard = torch.randn(4, 3)
    out = torch.zeros(4, 6, dtype=torch.bfloat16)
    for reg in shard_regions(role, shard, SPEC, 1, 2):
        reg.write(out)
    assert torch.equal(out[:, 3:], shard.to(torch.bfloat16)) and not out[:, :3].any()
    with pytest.raises(ValueError, match="unknown tensor kind"):
        shard_regions(ParamRole("bogus", ("x",)), shard, SPEC, 0, 1)
