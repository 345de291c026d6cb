"""Which local megatron tensor is which HF tensor: `param_role` and the one parameter walk.

`walk_local_tensors` is the single walk over a rank's model chunks used by import, export and the
weight bridge: parameters AND persistent buffers that map to HF names, in a deterministic order
(chunk order, then `state_dict` order) identical on all TP ranks of a stage.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from parallel.convert.layout import GATHER_DIM, ParamRole
from parallel.convert.registry import get_converter

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# SequentialMLP (local and TE specs without grouped GEMM) and TEGroupedMLP expert names
_SEQ_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")

NameMapHook = Callable[[Any, str, torch.Tensor], "ParamRole | None"]
"""name_map(chunk, local_name, tensor) -> ParamRole or None (None: use the family's map)."""


def regex_name_map(rules: Mapping[str, tuple[str, str]]) -> NameMapHook:
    """A `name_map` hook from ``{regex on the local megatron name: (kind, HF name template)}``.

    kind is one of the converter's kinds (``GATHER_DIM``: "replicated", "row", "vocab", "fc1", "qkv",
    "qkv_bias"; it says how TP shards are joined).  The template may use ``{layer}`` (the *global* layer
    index of a ``decoder.layers.<i>.`` name) and the regex's named groups; kinds with several HF tensors
    ("fc1": gate, up; "qkv": q, k, v) take the names separated by commas.
    Raises ValueError for an unknown kind.
    """
    compiled = [(re.compile(p), kind, tmpl) for p, (kind, tmpl) in rules.items()]
    for _, kind, _ in compiled:
        if kind not in GATHER_DIM:
            raise ValueError(f"unknown kind {kind!r}; use one of {sorted(GATHER_DIM)}")

    def name_map(chunk, local_name: str, tensor: torch.Tensor):
        for rx, kind, tmpl in compiled:
            m = rx.fullmatch(local_name)
            if not m:
                continue
            fields = dict(m.groupdict())
            lm = _LAYER_RE.match(local_name)
            if lm:
                fields["layer"] = chunk.decoder.layers[int(lm.group(1))].layer_number - 1
            return ParamRole(kind, tuple(s.strip().format(**fields) for s in tmpl.split(",")))
        return None

    return name_map


def unwrap_model(model):
    """Strip DDP / Float16Module wrappers down to the GPTModel."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _normalise_expert(suffix: str) -> tuple[str, int | None]:
    """'mlp.experts.local_experts.3.linear_fc1.weight' -> ('mlp.experts.{expert}.linear_fc1.weight', 3)."""
    m = _SEQ_EXPERT_RE.match(suffix)
    if m:
        return f"mlp.experts.{{expert}}.{m.group(2)}", int(m.group(1))
    m = _GROUPED_EXPERT_RE.match(suffix)
    if m:
        return f"mlp.experts.{{expert}}.{m.group(1)}.{m.group(2)}", int(m.group(3))
    return suffix, None


def param_role(local_name: str, module, spec, ep_rank: int | None = None) -> ParamRole | None:
    """Map a local megatron tensor name of `module` (one GPTModel chunk) to its HF tensors.

    Uses the name map of the family registered for `spec.architecture`.  Layer indices become
    global (`layer_number - 1`, right under PP/VPP and uneven stages); local expert indices become
    global through the MoE layer's `local_expert_indices` (right under EP).  Tied models map
    `output_layer.weight` to ``model.embed_tokens.weight``.  Returns None for tensors with no HF
    counterpart by design (the critic's value head).  Raises KeyError for an unknown name.
    `ep_rank` names an expert tensor as it is on another expert-parallel rank (the same local
    index there holds expert ``ep_rank * num_local_experts + i``); export uses it to name the
    experts it gathers from the EP group.
    """
    family = get_converter(spec.architecture)
    if local_name == "output_layer.weight":
        if getattr(module, "is_value_model", False):
            return None
        if spec.tie_word_embeddings:
            return ParamRole("vocab", ("model.embed_tokens.weight",))
    if local_name in family.top_map:
        kind, names = family.top_map[local_name]
        return ParamRole(kind, tuple(names))
    m = _LAYER_RE.match(local_name)
    if m:
        layer = module.decoder.layers[int(m.group(1))]
        key, local_expert = _normalise_expert(m.group(2))
        if key in family.layer_map:
            kind, names = family.layer_map[key]
            prefix = f"model.layers.{layer.layer_number - 1}."
            fields = {}
            if local_expert is not None:
                mlp = layer.mlp
                fields["expert"] = (mlp.local_expert_indices[local_expert] if ep_rank is None
                                    else ep_rank * mlp.num_local_experts + local_expert)
            return ParamRole(kind, tuple(prefix + n.format(**fields) for n in names))
    raise KeyError(f"no Hugging Face mapping for megatron parameter {local_name!r} "
                   f"(model family {family.name!r}, architecture {spec.architecture!r})")


@dataclass(frozen=True)
class LocalTensor:
    """One local megatron tensor and the HF tensor(s) it maps to (role None: value head)."""

    chunk_index: int
    chunk: Any  # the unwrapped GPTModel
    local_name: str
    tensor: torch.Tensor
    role: ParamRole | None
    is_param: bool
    merge: Callable[[torch.Tensor], torch.Tensor] | None = None  # LoRA: base shard -> merged shard

    def values(self) -> torch.Tensor:
        """The local tensor's values to export or send, detached: the LoRA-merged shard ``W + (alpha / r) B A``
        for an adapted base weight (a new tensor each call; parallel.lora), else the tensor itself."""
        t = self.tensor.detach()
        return t if self.merge is None else self.merge(t)


def walk_local_tensors(model_chunks, spec, name_map: NameMapHook | None = None, include_value_head: bool = False,
                       skipped: list[str] | None = None, include_tied_copy: bool = False) -> Iterator[LocalTensor]:
    """Every parameter and persistent buffer of this rank's chunks that maps to HF tensors.

    Order: chunk order, then `state_dict` order; identical on all TP ranks of a stage (and on
    all EP ranks, whose local expert names coincide).  `name_map(chunk, local_name, tensor)` is
    consulted first; None falls back to `param_role`.  Skipped: None entries, ``_extra_state``,
    the tied `output_layer.weight` copy (the embedding is exported once; import passes
    `include_tied_copy=True` to fill the last stage's copy too), tensors whose role is
    None (the value head) unless `include_value_head`, and persistent buffers with no mapping
    (appended to `skipped` as ``"chunk<i>.<name>"`` when a list is given).
    Raises KeyError naming a *parameter* with no HF mapping (add a `name_map` rule for it) and
    ValueError for a role whose kind is not one of `GATHER_DIM`.

    LoRA (parallel.lora): the adapters' own tensors are skipped (they have no HF name); an adapted layer's
    weight carries a `merge`, so :meth:`LocalTensor.values` gives the merged weight.
    """
    from parallel.lora import CONTAINER, adapted_layers

    for ci, chunk in enumerate(model_chunks):
        chunk = unwrap_model(chunk)
        params = {n for n, _ in chunk.named_parameters()}
        merges = {f"{path}.weight": a.merged for path, a in adapted_layers(chunk).items()}
        is_value_model = getattr(chunk, "is_value_model", False)
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if (tensor is None or not torch.is_tensor(tensor) or name.endswith("_extra_state")
                    or name.startswith(CONTAINER + ".")):
                continue
            if (name == "output_layer.weight" and spec.tie_word_embeddings and not is_value_model
                    and not include_tied_copy):
                continue
            role = name_map(chunk, name, tensor) if name_map is not None else None
            if role is None:
                try:
                    role = param_role(name, chunk, spec)
                except KeyError:
                    if name in params:
                        raise KeyError(f"megatron parameter {name!r} (chunk {ci}) has no Hugging Face name; "
                                       f"add a `name_map` rule for it or a map entry in its model family") from None
                    if skipped is not None:
                        skipped.append(f"chunk{ci}.{name}")
                    continue
                if role is None and not include_value_head:
                    continue
            if role is not None and role.kind not in GATHER_DIM:
                raise ValueError(f"{name!r}: unknown role kind {role.kind!r}; use one of {sorted(GATHER_DIM)}")
            yield LocalTensor(ci, chunk, name, tensor, role, name in params, merges.get(name))


def iter_local_params(model_chunks, spec, include_value_head: bool = False):
    """Yield (chunk, local_name, tensor, role) for every parameter (and persistent buffer) this
    rank holds that maps to HF tensors; `walk_local_tensors` without hooks, as tuples.

    Tied embeddings: the last stage's `output_layer.weight` copy is skipped (HF exports no
    separate lm_head for tied models).
    """
    for t in walk_local_tensors(model_chunks, spec, include_value_head=include_value_head):
        yield t.chunk, t.local_name, t.tensor, t.role
