"""`ModelFamily`: what one model family file declares (its HF architectures and ONE name map).

A family maps megatron-core parameter names onto Hugging Face tensor names.  The same map serves
both directions (HF -> megatron import, megatron -> HF export and weight sync), so a round trip
is exact by construction.  Entries are

    megatron name (or per-layer suffix) -> (kind, HF name(s))

where `kind` (see `parallel.convert.layout`) says how megatron shards and packs the tensor.
Per-layer HF names are suffixes after ``model.layers.<global layer>.``; expert entries use the
placeholder ``{expert}`` for the *global* expert index (``mlp.experts.{expert}.linear_fc1.weight``
is the normalised megatron name of every expert layout: SequentialMLP's
``mlp.experts.local_experts.<i>.linear_fc1.weight`` and TEGroupedMLP's
``mlp.experts.linear_fc1.weight<i>``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

NameMap = Mapping[str, tuple[str, tuple[str, ...]]]


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its HF architectures and its megatron <-> HF name map.

    Attributes:
        name: short family name (docs, errors).
        architectures: HF `architectures[0]` values this family converts.
        model_types: HF `model_type` -> architecture, for configs without `architectures`.
        top_map: whole-model tensors (embedding, final norm, output layer).
        layer_map: per-layer suffixes (attention, norms, MLP or MoE).
        spec_fields: (hf_config, architecture) -> dict of HFModelSpec fields specific to the family (qkv_bias,
            qk_norm, MoE sizes); raises UnsupportedModelError for a config it cannot convert.
        features: one line for the supported-model table.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: Mapping[str, str]
    top_map: NameMap
    layer_map: NameMap
    spec_fields: Callable[[object, str], dict]
    features: str = ""
    extra: dict = field(default_factory=dict)
