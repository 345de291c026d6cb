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


def layer_spec(use_te: bool | None = None, spec: HFModelSpec | None = None, config=None, vp_stage: int | None = None):
    """Transformer Engine spec when TE and CUDA are present (or `use_te=True`), else the local spec.

    `use_te=None` takes `parallel.kernels.resolve_kernels()`: on GPU without TE that raises
    TransformerEngineMissingError unless ``RLHF_ALLOW_NO_TE=1``.

    With `spec`: q/k layernorm (Qwen3) and MoE layers (router + SequentialMLP experts, no grouped
    GEMM, so expert names are the same on CPU and GPU) as the model needs.  With a `config` under
    sequence parallelism the local spec becomes a block spec whose norms are `TorchRMSNorm`.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_te is None:
        use_te = resolve_kernels(use_te).use_te
    kw = {}
    if spec is not None:
        kw = dict(num_experts=spec.num_experts or None, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**kw)
    local = specs.get_gpt_layer_local_spec(normalization="RMSNorm", **kw)
    if config is None or not config.sequence_parallel:
        return local
    sub = local.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = TorchRMSNorm
    attn = sub.self_attention.submodules
    if spec is not None and spec.qk_norm:
        attn.q_layernorm = attn.k_layernorm = ModuleSpec(module=TorchRMSNorm, params={"mark_sequence_parallel": False})
    return TransformerBlockSubmodules(layer_specs=[local] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=TorchRMSNorm)


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
