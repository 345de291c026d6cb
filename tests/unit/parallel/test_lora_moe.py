"""LoRA on MoE experts (parallel/lora.py, parallel/lora_export.py) on real tiny megatron models, one gloo process
(TP1 x EP1): Qwen3-MoE (routed experts only) and DeepSeek-V3 (a dense first layer, shared experts, routed
experts).  B = 0 gives the base model's log-probs bitwise; with random B the megatron log-probs equal Hugging Face's
on the merged export, which equals the HF base weights + alpha/r * B A from the PEFT export (PEFT's merge formula);
PEFT names and shapes of the expert adapters; a trained step changes only adapter tensors.  EP2 (each rank holds its
experts' adapters) runs in tests/support/dist/lora_checks.py (phase ep2, tests/e2e/test_lora_dist.py)."""
from __future__ import annotations

import os

import pytest
import torch

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from tests.support.dist_utils import one_rank_grid

    with one_rank_grid(tmp_path_factory.mktemp("pg")):
        yield tmp_path_factory


def _build(grid, family, **kw):
    from transformers import AutoConfig

    from parallel.distributed import set_seed
    from parallel.lora import LoRASettings, apply_lora
    from parallel.models import build_model_chunks
    from tests.support.model_families import make_family_model

    path = str(grid.mktemp(family))
    make_family_model(path, family, num_layers=2)
    set_seed(0)
    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path)
    settings = LoRASettings(rank=RANK, alpha=ALPHA, **kw)
    count = apply_lora(bundle.chunks, settings)
    return path, bundle, settings, count


def _batch(seed=0, B=2, S=10, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, S), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0
    ids = torch.where(am.bool(), ids, torch.full_like(ids, 3))
    return dict(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0))


def _log_probs(bundle, batch):
    from parallel.forward import forward_backward

    with torch.no_grad():
        return forward_backward(bundle.chunks, batch, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                                micro_batch_size=2)["log_probs"]


def _load(d):
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors") for k, v in load_file(f"{d}/{f}").items()}


def _hf_log_probs(path, batch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"]).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]


@pytest.mark.parametrize("family, adapters", [("qwen3_moe", 2 * (2 + 2 * 8)),  # per layer: qkv, proj, 8 x fc1/fc2
                                              ("deepseek_v3", 2 + (2 + 2 * 8))])  # dense fc1/fc2; shared + routed
def test_expert_lora_equals_hf_on_merged_export_and_peft_merge(grid, family, adapters):
    from transformers import AutoConfig

    from parallel.convert import save_hf_checkpoint
    from parallel.lora import adapted_layers, adapters_disabled
    from parallel.lora_export import gather_peft_adapter, peft_config, save_peft_adapter

    # targets: attention (megatron names; DeepSeek's MLA projections are not LoRA targets) + gate/up/down
    targets = ("linear_fc1", "linear_fc2") if family == "deepseek_v3" else ("linear_qkv", "linear_proj",
                                                                            "linear_fc1", "linear_fc2")
    path, bundle, settings, count = _build(grid, family, targets=targets)
    assert count == adapters
    batch = _batch()
    with adapters_disabled(bundle.chunks):
        base = _log_probs(bundle, batch)
    assert torch.equal(_log_probs(bundle, batch), base)  # B = 0: the base model exactly

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for a in adapted_layers(bundle.chunks[0]).values():
            a.b.copy_(0.2 * torch.randn(a.b.shape, generator=g))
    lora = _log_probs(bundle, batch)
    mask = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).bool()
    assert float((lora - base)[:, 1:][mask].abs().max()) > 1e-3  # the expert adapters act

    # export: PEFT names/shapes (expert e of layer l), merged HF weights = base + alpha/r B A (PEFT's formula)
    peft = gather_peft_adapter(bundle.chunks, bundle.spec)
    H, inter, E = 64, 32, 8
    for lyr in range(2):
        routed = f"base_model.model.model.layers.{lyr}.mlp.experts"
        if family == "deepseek_v3" and lyr == 0:  # first_k_dense_replace=1: a dense MLP
            assert peft["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (96, RANK)
            assert not any(".experts." in k for k in peft if ".layers.0." in k)
            continue
        for e in range(E):
            assert peft[f"{routed}.{e}.gate_proj.lora_A.weight"].shape == (RANK, H)
            assert peft[f"{routed}.{e}.up_proj.lora_B.weight"].shape == (inter, RANK)
            assert peft[f"{routed}.{e}.down_proj.lora_A.weight"].shape == (RANK, inter)
            assert peft[f"{routed}.{e}.down_proj.lora_B.weight"].shape == (H, RANK)
        if family == "deepseek_v3":
            assert peft[f"base_model.model.model.layers.{lyr}.mlp.shared_experts.up_proj.lora_B.weight"].shape == (
                inter, RANK)
    assert len(peft) == 2 * _peft_modules(family, targets)
    cfg = peft_config(settings, path, peft)
    assert set(cfg["target_modules"]) == ({"gate_proj", "up_proj", "down_proj"} if family == "deepseek_v3" else
                                          {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})

    merged_dir, peft_dir = str(grid.mktemp("merged")), str(grid.mktemp("peft"))
    save_hf_checkpoint(bundle.chunks, bundle.spec, AutoConfig.from_pretrained(path), merged_dir)
    save_peft_adapter(bundle.chunks, bundle.spec, settings, peft_dir, base_model=path)
    hf_base, merged = _load(path), _load(merged_dir)
    changed = 0
    for k in peft:
        if k.endswith(".lora_A.weight"):
            mod = k[len("base_model.model."):-len(".lora_A.weight")]
            want = hf_base[f"{mod}.weight"] + ALPHA / RANK * (peft[k.replace("lora_A", "lora_B")].double()
                                                             @ peft[k].double()).float()
            assert torch.allclose(merged[f"{mod}.weight"], want, atol=1e-6), mod
            changed += 1
    assert changed == _peft_modules(family, targets)
    untouched = [k for k in hf_base if not any(k == f"{m[len('base_model.model.'):-len('.lora_A.weight')]}.weight"
                                               for m in peft if m.endswith(".lora_A.weight"))]
    assert all(torch.equal(merged[k], hf_base[k]) for k in untouched)
    hf = _hf_log_probs(merged_dir, batch)
    assert float((hf - lora[:, 1:])[mask].abs().max()) < 1e-4


def _peft_modules(family, targets):
    """PEFT modules of the 2-layer tiny model: per routed-expert layer 8 experts x (gate, up, down)."""
    attn = 4 if "linear_qkv" in targets else 0
    if family == "qwen3_moe":
        return 2 * (attn + 8 * 3)
    return (attn + 3) + (attn + 3 + 8 * 3)  # DeepSeek-V3: dense layer 0; layer 1 shared + routed


def test_a_trained_step_changes_only_adapters(grid):
    from parallel.forward import forward_backward
    from parallel.lora import adapted_layers
    from parallel.optim import OptimConfig, build_train_state, optimizer_step, zero_grads

    _, bundle, _, _ = _build(grid, "qwen3_moe", targets=("linear_fc1", "linear_fc2"))
    state = build_train_state(bundle.chunks, bundle.config, OptimConfig(lr=5e-2, clip_grad=10.0))
    chunk = bundle.chunks[0]
    before = {n: p.detach().clone() for n, p in state.model[0].named_parameters()}
    adapters = adapted_layers(chunk)
    assert len(adapters) == 2 * 2 * 8 and all(".experts.local_experts." in p for p in adapters)
    opt = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    assert opt == {id(p) for a in adapters.values() for p in (a.a, a.b)} or len(opt) == 2 * len(adapters)

    def loss_fn(outputs, mb):
        mask = mb["attention_mask"].float()
        return -((outputs["log_probs"] * mask).sum(1) * torch.tensor([1.0, -0.5])).sum() / mask.sum(), {}

    zero_grads(state)
    forward_backward(state.model, _batch(3), kind="log_probs", vocab_size=bundle.spec.vocab_size, loss_fn=loss_fn,
                     forward_only=False, micro_batch_size=2)
    assert not optimizer_step(state).skipped
    after = dict(state.model[0].named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and all(".lora_adapters." in f".{n}" or n.startswith("lora_adapters.") for n in changed)
    # B of experts that received tokens moved (A's gradient is zero while B = 0)
    assert sum(n.endswith(".b") for n in changed) >= 8


def test_grouped_gemm_experts_are_refused_naming_the_fix(grid):
    from parallel.lora import LoRASettings, apply_lora

    class TEGroupedMLP(torch.nn.Module):  # megatron's grouped-GEMM experts module, by name
        pass

    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    chunk.decoder.layers[0].mlp = torch.nn.Module()
    chunk.decoder.layers[0].mlp.experts = TEGroupedMLP()
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp\.experts: LoRA on grouped-GEMM experts "
                                         r"\(TEGroupedMLP\).*moe_grouped_gemm=False.*drop gate_proj"):
        apply_lora([chunk], LoRASettings(rank=4, alpha=8.0))
    # attention-only targets pass the grouped experts by (this stand-in chunk has no attention: nothing matched)
    with pytest.raises(ValueError, match=r"LoRA targets \['linear_qkv'\] match no layer"):
        apply_lora([chunk], LoRASettings(rank=4, alpha=8.0, targets=("linear_qkv",)))
