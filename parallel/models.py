"""Actor, critic and reference models: megatron-core GPTModels built from a Hugging Face config.

`build_model_chunks` returns one GPTModel per virtual pipeline stage held by this rank (a list of
length 1 without VPP), already carrying the HF weights when `hf_path` is given.  The critic is the
same trunk with a scalar value head in place of the LM head; the reference model is a frozen
actor.  Transformer Engine layer spec on GPU, megatron's local spec on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel import cpu_patches  # noqa: F401  (must precede megatron.core imports)
from parallel.kernels import resolve_kernels
from parallel.model_config import HFModelSpec, hf_model_spec, padded_vocab_size, transformer_config_from_hf
from parallel.rope import apply_rope_scaling, gpt_rope_kwargs

ROLES = ("actor", "critic", "reference")


class ValueHead(torch.nn.Module):
    """Scalar value head: hidden [s, b, h] -> values [s, b, 1], replicated over TP.

    Stands in for GPTModel.output_layer, so it accepts (and ignores) the LM head's keyword args.
    Under sequence parallelism the hidden states are gathered first.  The head's computation (and
    the loss after it) is duplicated on every TP rank, so the gather's backward only splits the
    gradient back to this rank's sequence slice (`tensor_parallel_output_grad=False`); the default
    reduce-scatter would sum the TP ranks' identical gradients: every trunk gradient x TP, the
    head's own x 1.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=1.0 / hidden_size**0.5)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None, **kwargs):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype)), None


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm for megatron's local spec that also works under sequence parallelism.

    megatron's WrappedTorchNorm asserts `not config.sequence_parallel` (Apex/TE norms are the
    SP-capable ones).  Norms on sequence-parallel activations (layer inputs, final norm) mark their
    weight `.sequence_parallel` so megatron's finalize_model_grads all-reduces its gradient over
    TP; q/k norms see full heads on every rank and stay unmarked.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, mark_sequence_parallel: bool = True, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel and mark_sequence_parallel)


@dataclass
class ModelBundle:
    """What the trainer holds for one role."""

    role: str
    chunks: list  # GPTModel per virtual pipeline stage
    config: object  # megatron TransformerConfig
    spec: HFModelSpec
    padded_vocab_size: int


class LatentRMSNorm(TorchRMSNorm):
    """MLA's q/kv latent RMSNorm: eps 1e-6 whatever `rms_norm_eps` is (transformers' and DeepSeek's
    `q_a_layernorm` / `kv_a_layernorm`); sequence-parallel-marked like the layer norms (the latents
    are scattered back to the sequence-parallel layout before the norm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        from parallel.convert.deepseek_v3 import LATENT_NORM_EPS

        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS)


def mla_core_attention():
    """megatron's local `DotProductAttention` for MLA: that one has no `k_channels` / `v_channels`
    (query/key heads of qk_nope + qk_rope dims, value heads of v_head_dim), so its output width is
    taken from the value heads here.  Same math otherwise (baddbmm, masked softmax, bmm)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def _one_layer_spec(use_te: bool, spec: HFModelSpec | None, config, moe: bool):
    """One transformer layer's ModuleSpec (dense or MoE MLP; GQA or MLA attention)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    kw, mla = {}, spec is not None and spec.multi_latent_attention
    if spec is not None:
        kw = dict(num_experts=spec.num_experts if moe and spec.num_experts else None, moe_grouped_gemm=False,
                  qk_layernorm=spec.qk_norm or mla, multi_latent_attention=mla)
    if use_te:
        layer = specs.get_gpt_layer_with_transformer_engine_spec(**kw)
        if mla:  # column-parallel down projections, as on the local spec (one converter layout for both)
            from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

            attn = layer.submodules.self_attention.submodules
            attn.linear_q_down_proj = attn.linear_kv_down_proj = TEColumnParallelLinear
        return layer
    layer = specs.get_gpt_layer_local_spec(normalization="RMSNorm", **kw)
    sub = layer.submodules
    if mla:
        attn = sub.self_attention.submodules
        attn.q_layernorm = attn.kv_layernorm = LatentRMSNorm
        attn.core_attention = mla_core_attention()
    if config is None or not config.sequence_parallel:
        return layer
    sub.input_layernorm = sub.pre_mlp_layernorm = TorchRMSNorm
    if spec is not None and spec.qk_norm:
        attn = sub.self_attention.submodules
        attn.q_layernorm = attn.k_layernorm = ModuleSpec(module=TorchRMSNorm, params={"mark_sequence_parallel": False})
    return layer


def layer_spec(use_te: bool | None = None, spec: HFModelSpec | None = None, config=None, vp_stage: int | None = None):
    """Transformer Engine spec when TE and CUDA are present (or `use_te=True`), else the local spec.

    `use_te=None` takes `parallel.kernels.resolve_kernels()`: on GPU without TE that raises
    TransformerEngineMissingError unless ``RLHF_ALLOW_NO_TE=1``.

    With `spec`: q/k layernorm (Qwen3), multi-latent attention (DeepSeek-V3) and MoE layers
    (router + SequentialMLP experts, no grouped GEMM, so expert names are the same on CPU and GPU)
    as the model needs.  With a `config`, a block spec (this stage's layers) when the local spec
    runs under sequence parallelism (norms become `TorchRMSNorm`) or when some layers are dense
    and others MoE (`config.moe_layer_freq`, DeepSeek-V3's first_k_dense_replace).
    """
    from megatron.core.transformer.transformer_block import (LayerNormImpl, TransformerBlockSubmodules,
                                                             get_num_layers_to_build, get_transformer_layer_offset)

    if use_te is None:
        use_te = resolve_kernels(use_te).use_te
    freq = getattr(config, "moe_layer_freq", 1) if config is not None else 1
    mixed = isinstance(freq, list) and len(set(freq)) > 1
    if not mixed:
        layer = _one_layer_spec(use_te, spec, config, moe=True)
        if use_te or config is None or not config.sequence_parallel:
            return layer
        layers = [layer] * get_num_layers_to_build(config, vp_stage=vp_stage)
    else:
        dense, moe = _one_layer_spec(use_te, spec, config, moe=False), _one_layer_spec(use_te, spec, config, moe=True)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        layers = [moe if freq[i] else dense
                  for i in range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))]
    norm = TorchRMSNorm if not use_te and config.sequence_parallel else LayerNormImpl  # what megatron would pick
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def cast_params_(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every floating-point parameter `dtype`, in place (what Megatron-LM's Float16Module does to
    parameters; buffers such as RoPE frequencies are left alone).  megatron's local spec builds its torch
    RMSNorm weights in fp32 whatever `params_dtype` is; a bf16 model with fp32 norms breaks megatron's
    fp16/bf16 optimizer checkpoint (its state is matched to the model by position and shape) and
    exports mixed dtypes.  Returns how many parameters were cast."""
    n = 0
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += 1
    return n


def build_model_chunks(hf_config, role: str = "actor", hf_path: str | None = None, *,
                       make_vocab_size_divisible_by: int = 128, params_dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False, recompute: str | None = None, use_te: bool | None = None,
                       **config_overrides) -> ModelBundle:
    """Build this rank's GPTModel chunk(s) for `role` in {"actor", "critic", "reference"}.

    Requires `parallel.distributed.init_model_parallel` first; TP/PP/VPP/EP/CP come from megatron's
    parallel_state. With `hf_path` the HF safetensors weights are loaded shard by shard.
    `config_overrides` go to `transformer_config_from_hf`, e.g. `num_layers_in_first_pipeline_stage`,
    `num_layers_in_last_pipeline_stage` (uneven pipelines) and `moe_aux_loss_coeff` (MoE).
    Raises ValueError for an unknown role or a layout that does not divide the model (before
    any allocation), UnsupportedModelError for an unsupported architecture.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if role not in ROLES:
        raise ValueError(f"role={role!r}; expected one of {ROLES}")
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    config = transformer_config_from_hf(hf_config, tp=tp, pp=pp, vpp=vpp, params_dtype=params_dtype,
                                        sequence_parallel=sequence_parallel, recompute=recompute, ep=ep, cp=cp,
                                        use_te=use_te, **config_overrides)
    spec = hf_model_spec(hf_config)
    if spec.is_moe:
        cpu_patches.patch_moe_without_te()
    if spec.multi_latent_attention:
        cpu_patches.patch_mla_without_te()
    vocab = padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by, tp)
    is_critic = role == "critic"
    chunks = []
    for vp_stage in range(vpp or 1):
        vp = vp_stage if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec(use_te, spec, config, vp), vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings, pre_process=pre, post_process=post,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not is_critic,
            vp_stage=vp, **gpt_rope_kwargs(spec),
        )
        apply_rope_scaling(model, hf_config, spec)
        cast_params_(model, params_dtype)
        if is_critic and post:
            model.output_layer = ValueHead(spec.hidden_size, config.sequence_parallel, params_dtype)
            model.is_value_model = True
        if role == "reference":
            model.requires_grad_(False)
            model.eval()
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    bundle = ModelBundle(role, chunks, config, spec, vocab)
    if hf_path is not None:
        from parallel.convert import load_hf_checkpoint

        load_hf_checkpoint(chunks, hf_path, spec)
        if spec.tie_word_embeddings and not is_critic and pp > 1:
            # megatron syncs the last stage's output_layer copy from the embedding only at init;
            # both were loaded from embed_tokens, so they already agree.
            pass
    return bundle


def build_from_hf(hf_path_or_name: str, role: str = "actor", **kwargs) -> ModelBundle:
    """Load the HF config from a local directory or hub name, then `build_model_chunks` with weights.

    A hub name is downloaded with `huggingface_hub.snapshot_download` (safetensors only).
    """
    import os

    from transformers import AutoConfig

    path = hf_path_or_name
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(hf_path_or_name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    hf_config = AutoConfig.from_pretrained(path)
    return build_model_chunks(hf_config, role=role, hf_path=path, **kwargs)
