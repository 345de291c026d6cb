"""The send plan of a weight sync: which HF tensors each pipeline stage sends, validated against the engines and
split into buckets.  No data moves while planning: names and full shapes come from the converter run on *meta* shards.
SGLang silently ignores an unknown name and kills its scheduler on a wrong shape, so every name and shape is checked
before anything is sent, and engine weights nothing maps to are refused too (they would keep stale values).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from parallel.convert import GATHER_DIM, LocalTensor, hf_tensors_from_shards, regex_name_map, walk_local_tensors
from parallel.convert.params import NameMapHook as NameMap
from parallel.convert.params import param_role
from parallel.model_config import HFModelSpec
from rlhf.weight_bridge.bucketing import BucketPlan, TensorMeta, plan_buckets

__all__ = ["WeightBridgeError", "normalize_expected", "validate_against_expected", "NameMap", "regex_name_map",
           "sync_entries", "plan_local_tensors", "StagePlan", "SendPlan", "build_send_plan"]


class WeightBridgeError(RuntimeError):
    """A weight sync was refused or failed; the message names the offending tensor(s)."""


def normalize_expected(expected: Mapping) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """``{name: (shape tuple of ints, dtype)}`` from the engines' ``{name: (shape, dtype)}`` (expected_weights)."""
    return {name: (tuple(int(d) for d in shape), dt) for name, (shape, dt) in expected.items()}


def validate_against_expected(stage_tensors: Mapping[int, Sequence[tuple[str, tuple, Any]]], expected: Mapping,
                              tie_word_embeddings: bool) -> list[str]:
    """Check ``stage_tensors`` ``{pp_rank: [(HF name, shape, dtype), ...]}`` against the rollout engines' ``expected``
    ``{HF name: (shape, dtype)}``; ``lm_head.weight`` may stay unsent with ``tie_word_embeddings``.  Returns one line
    per problem (none: everything matches): a name the engine does not have (with the closest expected names), a
    shape differing from the engine's, a name sent by two stages, an engine weight nothing maps to."""
    exp = normalize_expected(expected)
    problems, owner = [], {}
    for pp_rank in sorted(stage_tensors):
        for name, shape, _dt in stage_tensors[pp_rank]:
            shape = tuple(int(s) for s in shape)
            if name in owner:
                problems.append(f"weight {name!r} would be sent twice (from pipeline stage {owner[name]} and again "
                                f"from stage {pp_rank}): two trainer tensors map to it")
            owner.setdefault(name, pp_rank)
            if name not in exp:
                close = difflib.get_close_matches(name, list(exp), n=3, cutoff=0.6)
                problems.append(f"weight {name!r} (shape {shape}, pipeline stage {pp_rank}) is not a weight of the "
                                f"rollout engines (SGLang would silently ignore it); closest expected names: {close}")
            elif exp[name][0] != shape:
                problems.append(f"weight {name!r}: the bridge would send shape {shape} but the rollout engines expects "
                                f"{exp[name][0]} (SGLang would crash on it)")
    for name, (shape, _dt) in exp.items():
        if name not in owner and not (name == "lm_head.weight" and tie_word_embeddings):
            problems.append(f"the rollout engines expects weight {name!r} (shape {shape}) but no trainer tensor "
                            f"maps to it: it would keep stale values")
    return problems


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def sync_entries(model_chunks, spec: HFModelSpec, name_map: NameMap | None,
                 topo) -> tuple[list[LocalTensor], list[str]]:
    """What this rank streams: every parameter and persistent buffer of its chunks that maps to HF tensors
    (:func:`parallel.convert.walk_local_tensors`) on data-parallel replica 0, only the routed experts on an expert
    peer, nothing elsewhere; and the skipped unmapped buffers (``"chunk<i>.<name>"``).  Raises WeightBridgeError for
    a parameter with no HF mapping."""
    if not (topo.active or topo.expert_peer):
        return [], []
    skipped: list[str] = []
    try:
        entries = list(walk_local_tensors(model_chunks, spec, name_map=name_map, skipped=skipped))
    except (KeyError, ValueError) as e:
        raise WeightBridgeError(f"{e.args[0]}: the engine could not be updated with it") from None
    if topo.active:
        return entries, skipped
    return [e for e in entries if e.role is not None and e.role.is_expert], []


def plan_local_tensors(entries: Sequence[LocalTensor], spec: HFModelSpec, tp: int,
                       ep: int = 1) -> list[tuple[str, tuple, torch.dtype]]:
    """``(HF name, full shape, source dtype)`` of every HF tensor `entries` convert to, in send order (the converter
    on meta tensors); with `ep` > 1 a routed expert tensor stands for that local expert of every EP rank, in order."""
    out = []
    for e in entries:
        meta = torch.empty(tuple(e.tensor.shape), dtype=e.tensor.dtype, device="meta")
        shards = [meta] if GATHER_DIM[e.role.kind] is None else [meta] * tp
        converted = hf_tensors_from_shards(e.role, shards, spec)
        names = ([param_role(e.local_name, e.chunk, spec, ep_rank=r).hf_names for r in range(ep)]
                 if ep > 1 and e.role.is_expert else [[name for name, _ in converted]])
        out += [(name, tuple(t.shape), e.tensor.dtype) for ns in names for name, (_, t) in zip(ns, converted)]
    return out


@dataclass
class StagePlan:
    """What one PP stage sends: its leader's global rank, tensors (target dtypes) and buckets."""

    pp_rank: int
    leader: int
    metas: list[TensorMeta]
    buckets: list[BucketPlan]


@dataclass
class SendPlan:
    """The validated plan: per-stage tensors and buckets (stage order = send order), names read back in check mode."""

    stages: list[StagePlan]
    check_names: list[str]

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for s in self.stages for m in s.metas)

    @property
    def num_tensors(self) -> int:
        return sum(len(s.metas) for s in self.stages)

    @property
    def num_buckets(self) -> int:
        return sum(len(s.buckets) for s in self.stages)

    def is_last(self, stage: StagePlan, bucket: BucketPlan) -> bool:
        return stage is self.stages[-1] and bucket is stage.buckets[-1]


def _check_names(names: list[str], check: str | None) -> list[str]:
    if check == "all":
        return names
    if check != "sample":
        return []
    layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
    keep = {layers[0], layers[-1]} if layers else set()
    return [n for n in names if not (m := _LAYER.match(n)) or int(m.group(1)) in keep]


def build_send_plan(reports: list, controller: int, expected: Mapping, spec: HFModelSpec, *, bucket_bytes: int,
                    check: str | None) -> SendPlan:
    """Controller: the stage leaders' reports (``{"pp_rank", "rank", "tensors", ...}``; None from other ranks) ->
    the validated SendPlan, tensors in the engine's dtype of each weight (else their own).  Raises WeightBridgeError
    for two leaders of a stage, a stage 0 not led by the controller, or any mismatch with ``expected`` (all listed)."""
    by_stage = {}
    for r in filter(None, reports):
        if r["pp_rank"] in by_stage:
            raise WeightBridgeError(f"two leaders for pipeline stage {r['pp_rank']}")
        by_stage[r["pp_rank"]] = r
    if 0 not in by_stage or by_stage[0]["rank"] != controller:
        raise WeightBridgeError(f"global rank {controller} must lead pipeline stage 0 (tp rank 0, dp rank 0); "
                                f"megatron's rank order puts it there by default")
    problems = validate_against_expected({p: r["tensors"] for p, r in by_stage.items()}, expected,
                                         spec.tie_word_embeddings)
    if problems:
        more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
        raise WeightBridgeError("weight sync refused before sending anything:\n  " + "\n  ".join(problems[:20]) + more)
    stages = []
    for p in sorted(by_stage):
        r = by_stage[p]
        metas = [TensorMeta(name, tuple(shape), expected[name][1] or src) for name, shape, src in r["tensors"]]
        stages.append(StagePlan(p, r["rank"], metas, plan_buckets(metas, bucket_bytes)))
    return SendPlan(stages, _check_names([m.name for s in stages for m in s.metas], check))
