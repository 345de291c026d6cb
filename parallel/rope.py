"""Rotary position embeddings of HF configs on megatron-core's GPTModel.

Supported `rope_type`s: ``default`` (plain RoPE, theta from the config), ``llama3`` (Llama 3.1 /
3.2 / 3.3 frequency scaling) and ``linear`` (position interpolation).  The frequencies equal
those of transformers bitwise:

* ``llama3`` with low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192
  (every Llama 3.x release) uses megatron-core's own option (`rope_scaling=True`,
  `rope_scaling_factor`), whose formula is transformers' with those constants;
* any other ``llama3`` parameters and ``linear`` get transformers' own inverse frequencies
  (`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`) written into the model's rotary
  embedding after it is built.

Types whose frequencies depend on the sequence length at run time (``dynamic``) or that scale
attention (``yarn``, ``longrope``) are refused with the supported list, except ``yarn`` for
multi-latent attention (DeepSeek-V3): megatron-core's MLA layers carry their own YaRN rotary
embedding and softmax scale (`parallel.convert.deepseek_v3.megatron_rope`), so the family lists
it in its `extra["rope_types"]` and `apply_rope_scaling` leaves MLA models alone.
"""
from __future__ import annotations

from parallel.convert.spec import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_WHY_NOT = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length at run time",
    "yarn": "YaRN also scales the attention logits (mscale), which megatron-core's GPT RoPE does not",
    "longrope": "LongRoPE uses per-dimension factors and attention scaling megatron-core's GPT RoPE lacks",
}


def rope_parameters(hf_config, supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, dict | None]:
    """(rope_theta, scaling) of a HF config; scaling is None for plain RoPE, else the rope
    parameters dict with its normalised ``rope_type``.

    Reads transformers >= 5 `rope_parameters` and legacy `rope_theta` / `rope_scaling`.
    `supported`: the rope types the model family accepts (default SUPPORTED_ROPE_TYPES).
    Raises UnsupportedModelError for a rope type outside `supported`, naming why.
    """
    params = getattr(hf_config, "rope_parameters", None)
    params = dict(params) if isinstance(params, dict) and "rope_theta" in params else {}
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = float(getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in supported:
        why = _WHY_NOT.get(rope_type, "it has no megatron-core equivalent here")
        raise UnsupportedModelError(f"rope_type={rope_type!r} is not supported ({why}); supported rope types: "
                                    f"{', '.join(supported)}")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise UnsupportedModelError(f"rope_type={rope_type!r} without a 'factor' in {params!r}")
    params["rope_type"] = rope_type
    return theta, params


def megatron_llama3_covers(scaling: dict | None) -> bool:
    """True when megatron-core's built-in Llama-3 scaling (fixed low/high factors and original
    context) reproduces `scaling` exactly."""
    return bool(scaling) and scaling["rope_type"] == "llama3" and all(
        float(scaling.get(k, v)) == v for k, v in _MEGATRON_LLAMA3.items())


def gpt_rope_kwargs(spec) -> dict:
    """GPTModel keyword arguments for the spec's RoPE (`rotary_base`, and megatron's Llama-3 option)."""
    kw = {"position_embedding_type": "rope", "rotary_base": spec.rope_theta}
    if megatron_llama3_covers(spec.rope_scaling):
        kw.update(rope_scaling=True, rope_scaling_factor=float(spec.rope_scaling["factor"]))
    return kw


def hf_inv_freq(hf_config):
    """transformers' inverse frequencies [head_dim / 2] (float32) for the config's rope type."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, scaling = rope_parameters(hf_config)
    if scaling is None:
        raise ValueError("plain RoPE: megatron-core computes these frequencies itself")
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, torch.device("cpu"))
    if attention_factor != 1.0:
        raise UnsupportedModelError(f"rope parameters {scaling!r} scale attention by {attention_factor}; "
                                    f"megatron-core's GPT RoPE cannot")
    return inv_freq.float()


def apply_rope_scaling(model, hf_config, spec) -> None:
    """Give a built GPTModel chunk transformers' frequencies where megatron's own option cannot
    express the config's rope scaling (no-op for plain RoPE, Llama-3.x-standard llama3 and MLA,
    whose attention layers build their own rotary embedding)."""
    if spec.rope_scaling is None or megatron_llama3_covers(spec.rope_scaling) or spec.multi_latent_attention:
        return
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise UnsupportedModelError("the model has no rotary_pos_emb to scale")
    rotary.inv_freq = hf_inv_freq(hf_config).to(rotary.inv_freq.device)
