"""Weight bridge: stream the actor's megatron weights into SGLang rollout engines after each update.

What it does, per `WeightBridge.sync()` (a collective over every trainer rank):

1. **Plan** (no tensor data moves).  Every rank lists the parameters (and mapped persistent
   buffers) of its own model chunks; the HF names and full shapes they convert to are computed
   with `hf_conversion.hf_tensors_from_shards` on *meta* tensors, i.e. with the very function that
   later converts the data.  The plans of all pipeline stages go to the controller (global rank 0,
   the only rank holding the engine handles = "sinks").
2. **Validate** EVERY name and shape against each engine's `expected_weights()` before anything
   is sent (SGLang silently ignores unknown names and kills its scheduler on a wrong shape).  A
   mismatch raises `WeightBridgeError` on every rank, naming the tensor, the shape we would send
   and the one the engine expects; nothing has been sent.  Engine weights that no trainer tensor
   maps to are refused as well (they would silently stay stale).
3. **Stream** in buckets (default 512 MiB).  Per parameter the TP group *gathers* (not
   all-gathers) its shards on the stage leader (tp rank 0 of data-parallel replica 0), which
   converts them to HF tensors (q/k/v split out of megatron's per-group interleave, [gate; up]
   split, padded vocabulary rows trimmed) and copies them, cast to the engine dtype, into a flat
   bucket buffer (layout of SGLang's ``FlattenedTensorBucket``).  No rank ever holds the whole
   model: extra memory is one bucket buffer plus, transiently, one gathered parameter and its
   converted copy (two bucket buffers with `overlap=True`, where a thread converts bucket k+1
   while bucket k is delivered); a single tensor larger than a bucket travels in its own memory.
   Other data-parallel replicas do nothing.  On CPU with all TP ranks on one host the gather
   goes through /dev/shm staging files instead of gloo (`MegatronTopology.prepare`): gloo moves a
   few hundred MB/s over loopback TCP, shared memory is a memcpy.
4. **Deliver**, one of two transports:

   * ``"tensor"`` (colocated): the controller calls ``update_weights_from_tensor(named_tensors)``
     on each sink, inside ``begin_weight_update()`` / ``end_weight_update()``; on GPU SGLang turns
     the tensors into CUDA IPC handles.  Under PP the other stages' leaders ship their buckets
     to the controller point-to-point (one flat message per bucket), so exactly one process
     talks to the engine.
   * ``"distributed"`` (disaggregated): one weight-update process group per PP stage
     (``{group_prefix}_pp{p}``), whose rank 0 is that stage's leader and whose other ranks are
     the engines' TP ranks (`init_weights_update_group`, NCCL on GPU, gloo on CPU).  Each stage
     broadcasts its own layers directly to the engines; the controller only issues the
     ``update_weights_from_distributed_async`` requests (names, dtypes, shapes) and waits for
     them.  SGLang always broadcasts from group rank 0, hence one group per stage rather than one
     group with several sources.  Stages are sent one after the other (the engine processes one
     request at a time).

   The engine's KV/radix cache (activations of the old weights) is flushed once per sync: with the
   last update call when the sink's method takes ``flush_cache=`` (all others pass False), else
   by a final ``flush_cache()``.

SGLang slices its own TP shards out of the full HF tensors (including rollout TP > number of KV
heads, where it replicates KV heads), so the bridge is independent of the rollout TP size.

Tied embeddings: only ``model.embed_tokens.weight`` is sent (the last stage's megatron
``output_layer.weight`` is a copy of it).  SGLang's Llama/Qwen2 with ``tie_word_embeddings`` and
no engine PP alias ``lm_head`` to ``embed_tokens`` (``lm_head.weight`` is not even a parameter;
Llama's loader skips an incoming ``lm_head.weight`` and Qwen2's copies ``embed_tokens`` into it
when it exists), so ``embed_tokens`` is exactly what the engine needs.

Persistent buffers: `state_dict()` entries that are not parameters are sent when they map to a
HF tensor, either by the standard name map (`hf_conversion.param_role`, e.g. a frozen norm kept as
a buffer under its usual name) or by a `name_map` hook (`regex_name_map`).  Unmapped buffers are
skipped and listed in `SyncStats.skipped_buffers`; an unmapped *parameter* is an error.

Failure semantics: every rank raises the same WeightBridgeError.  Refusals (plan/validation,
`begin_weight_update`) happen before any weight moves.  An engine error during delivery leaves
that engine with a mix of old and new weights (sync again); colocated, the controller keeps
draining the other stages' buckets so no sender blocks; disaggregated, a dead engine makes the
stage leaders' broadcasts fail only after the group timeout (`timeout_s`).

Typical use (every trainer rank)::

    sinks = [engine] if dist.get_rank() == 0 else None      # engine handles live on rank 0
    bridge = WeightBridge(actor.chunks, actor.spec, sinks, transport="tensor")
    ...
    optimizer.step()
    stats = bridge.sync()
"""
from __future__ import annotations

import datetime
import difflib
import os
import queue
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from rlhf import faults
from rlhf.mcore.weight_sync.bucketing import (DEFAULT_BUCKET_BYTES, BucketPlan, BufferPool, MemoryMeter, TensorMeta,
                                bucket_views, dtype_from_any, dtype_name, fill_buckets, plan_buckets)
from rlhf.mcore.convert import GATHER_DIM, ParamRole, hf_tensors_from_shards, param_role, unwrap_model
from rlhf.mcore.model_config import HFModelSpec

__all__ = [
    "WeightBridgeError", "WeightSink", "DistributedWeightSink", "WeightBridge", "SyncStats", "CheckReport",
    "InMemorySink", "expected_weights_from_spec", "regex_name_map", "local_entries", "plan_local_tensors",
    "validate_against_expected", "SimulatedTPTopology", "MegatronTopology",
]


class WeightBridgeError(RuntimeError):
    """A weight sync was refused or failed; the message names the offending tensor(s)."""


# ----------------------------------------------------------------------------------------------
# what the bridge needs from an engine
# ----------------------------------------------------------------------------------------------
@runtime_checkable
class WeightSink(Protocol):
    """The part of a rollout engine (e.g. `rlhf.rollout.RolloutEngine`) the colocated transport uses.

    Results may be None/True, a `(success: bool, message)` tuple, a dict with "success", or an
    object with a `.success` attribute; a failure becomes a WeightBridgeError.
    """

    def expected_weights(self) -> Mapping[str, tuple[Sequence[int], Any]]:
        """{HF name: (full shape, dtype)} of every weight the engine's model loads."""

    def begin_weight_update(self) -> Any: ...

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]]) -> Any:
        """Load full HF-named tensors (the engine slices its own TP shards)."""

    def end_weight_update(self) -> Any: ...

    def flush_cache(self) -> Any: ...


@runtime_checkable
class DistributedWeightSink(WeightSink, Protocol):
    """Additionally needed by the disaggregated (``"distributed"``) transport."""

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> Any: ...

    def update_weights_from_distributed_async(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str) -> Any:
        """Start receiving one bucket by broadcast from group rank 0; returns a handle with `.wait()`."""


_SINK_METHODS = ("expected_weights", "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
                 "flush_cache")
_DIST_SINK_METHODS = ("init_weights_update_group", "update_weights_from_distributed_async")


def _check_result(result, what: str) -> None:
    if result is None or result is True:
        return
    ok, msg = True, ""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, msg = result[0], " ".join(str(x) for x in result[1:])
    elif isinstance(result, dict) and "success" in result:
        ok, msg = bool(result["success"]), result.get("message", "")
    elif hasattr(result, "success") and isinstance(getattr(result, "success"), bool):
        ok, msg = result.success, getattr(result, "message", "")
    elif result is False:
        ok = False
    if not ok:
        raise WeightBridgeError(f"{what} failed: {msg}")


def _accepts_kwarg(fn, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _sink_label(i: int, sink) -> str:
    return getattr(sink, "name", None) or f"engine{i}"


def _sink_num_ranks(sink) -> int:
    """How many ranks an engine contributes to a weight-update group (its TP size x PP size)."""
    for attr in ("weight_update_world_size", "num_weight_update_ranks"):
        v = getattr(sink, attr, None)
        if v is not None:
            return int(v() if callable(v) else v)
    tp = getattr(sink, "tp_size", None)
    if tp is None:
        cfg = getattr(sink, "config", None) or getattr(sink, "server_args", None)
        tp = getattr(cfg, "tp_size", None)
    if tp is None:
        raise WeightBridgeError(f"cannot tell how many ranks {sink!r} has: give it a `tp_size` or "
                                f"`weight_update_world_size` attribute")
    pp = getattr(sink, "pp_size", None) or getattr(getattr(sink, "config", None), "pp_size", None) or 1
    return int(tp) * int(pp)


# ----------------------------------------------------------------------------------------------
# megatron state dict -> HF tensors
# ----------------------------------------------------------------------------------------------
NameMap = Callable[[Any, str, torch.Tensor], "ParamRole | None"]


def regex_name_map(rules: Mapping[str, tuple[str, str]]) -> NameMap:
    """Build a `name_map` hook from {regex on the local megatron name: (kind, HF name template)}.

    kind is one of hf_conversion's kinds ("replicated", "row", "vocab", "fc1", "qkv", "qkv_bias";
    it says how TP shards are joined).  The template may use ``{layer}`` (the *global* layer index
    of a ``decoder.layers.<i>.`` name) and the regex's named groups.  For kinds with several HF
    tensors ("fc1": gate, up; "qkv"/"qkv_bias": q, k, v) give the names separated by commas.
    Example: ``{r"decoder\\.final_layernorm\\.frozen_gain": ("replicated", "model.norm.weight")}``.
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
            lm = re.match(r"^decoder\.layers\.(\d+)\.", local_name)
            if lm:
                fields["layer"] = chunk.decoder.layers[int(lm.group(1))].layer_number - 1
            return ParamRole(kind, tuple(s.strip().format(**fields) for s in tmpl.split(",")))
        return None

    return name_map


@dataclass
class _Entry:
    """One local megatron tensor that maps to HF tensor(s)."""

    chunk_index: int
    local_name: str
    tensor: torch.Tensor
    role: ParamRole
    is_param: bool


def local_entries(model_chunks, spec: HFModelSpec, name_map: NameMap | None = None
                  ) -> tuple[list[_Entry], list[str]]:
    """Every parameter and persistent buffer of this rank's chunks that maps to HF tensors.

    Order is deterministic (chunk order, then state_dict order) and identical on all TP ranks of
    a stage.  `name_map(chunk, local_name, tensor)` is consulted first; None falls back to
    `hf_conversion.param_role`.  Skipped: `_extra_state`, the tied `output_layer.weight` copy,
    tensors whose role is None (the critic's value head), and persistent buffers with no mapping
    (returned as the second element, "chunk<i>.<name>").
    Raises WeightBridgeError for a parameter with no HF mapping.
    """
    entries, skipped = [], []
    for ci, chunk in enumerate(model_chunks):
        chunk = unwrap_model(chunk)
        params = {n for n, _ in chunk.named_parameters()}
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if tensor is None or not torch.is_tensor(tensor) or name.endswith("_extra_state"):
                continue
            if (name == "output_layer.weight" and spec.tie_word_embeddings
                    and not getattr(chunk, "is_value_model", False)):
                continue
            role = name_map(chunk, name, tensor) if name_map is not None else None
            if role is None:
                try:
                    role = param_role(name, chunk, spec)
                except KeyError:
                    if name in params:
                        raise WeightBridgeError(
                            f"megatron parameter {name!r} (chunk {ci}) has no Hugging Face name: the engine "
                            f"could not be updated with it; add a `name_map` rule for it") from None
                    skipped.append(f"chunk{ci}.{name}")
                    continue
                if role is None:
                    continue
            if role.kind not in GATHER_DIM:
                raise WeightBridgeError(f"{name!r}: unknown role kind {role.kind!r}")
            entries.append(_Entry(ci, name, tensor, role, name in params))
    return entries, skipped


def _meta_shards(entry: _Entry, tp: int) -> list[torch.Tensor]:
    t = entry.tensor
    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    return [meta] if GATHER_DIM[entry.role.kind] is None else [meta] * tp


def plan_local_tensors(entries: Sequence[_Entry], spec: HFModelSpec, tp: int) -> list[tuple[str, tuple, torch.dtype]]:
    """(HF name, full shape, source dtype) of every HF tensor `entries` convert to, in send order.

    Uses `hf_tensors_from_shards` on meta tensors (no data, no communication), so the plan is
    produced by the same code as the data.
    """
    out = []
    for e in entries:
        for name, t in hf_tensors_from_shards(e.role, _meta_shards(e, tp), spec):
            out.append((name, tuple(t.shape), e.tensor.dtype))
    return out


def expected_weights_from_spec(spec: HFModelSpec, dtype=torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{HF name: (shape, dtype)} of a Llama/Qwen2 checkpoint described by `spec` (what SGLang's
    loader accepts for it).  Tied models have no ``lm_head.weight``.  For fakes and tests; a real
    engine reports its own `expected_weights()`."""
    H, d, I = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    dtype = dtype_from_any(dtype)
    w = {"model.embed_tokens.weight": (spec.vocab_size, H), "model.norm.weight": (H,)}
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = (spec.vocab_size, H)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                  p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                  p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                  p + "mlp.down_proj.weight": (H, I)})
        if spec.qkv_bias:
            w.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)})
    return {k: (tuple(v), dtype) for k, v in w.items()}


def _normalize_expected(expected: Mapping) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    out = {}
    for name, val in expected.items():
        if isinstance(val, Mapping):
            shape, dt = val.get("shape"), val.get("dtype")
        elif isinstance(val, (tuple, list)) and len(val) == 2 and isinstance(val[0], (tuple, list, torch.Size)):
            shape, dt = val
        else:
            shape, dt = val, None
        out[name] = (tuple(int(s) for s in shape), None if dt is None else dtype_from_any(dt))
    return out


def _tied_lm_head_ok(name: str, spec: HFModelSpec) -> bool:
    return name == "lm_head.weight" and spec.tie_word_embeddings


def validate_against_expected(stage_tensors: Mapping[int, Sequence[tuple[str, tuple, Any]]],
                              expected: Mapping, spec: HFModelSpec, engine: str = "engine",
                              allow_missing: Callable[[str], bool] | None = None) -> list[str]:
    """Check the tensors every PP stage would send against one engine's expected weights.

    stage_tensors: {pp_rank: [(HF name, shape, dtype), ...]}; expected: {HF name: (shape, dtype)}.
    Returns a list of problems (empty when everything matches): a name the engine does not have
    (with the closest expected names), a shape differing from the engine's, a name sent by two
    stages, an engine weight nothing maps to (``lm_head.weight`` of tied models and names for
    which `allow_missing(name)` is true are exempt).  Pure function.
    """
    exp = _normalize_expected(expected)
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
                problems.append(f"weight {name!r} (shape {shape}, pipeline stage {pp_rank}) is not a weight of "
                                f"{engine} (SGLang would silently ignore it); closest expected names: {close}")
            elif exp[name][0] != shape:
                problems.append(f"weight {name!r}: the bridge would send shape {shape} but {engine} expects "
                                f"{exp[name][0]} (SGLang would crash on it)")
    for name, (shape, _dt) in exp.items():
        if name not in owner and not _tied_lm_head_ok(name, spec) and not (allow_missing and allow_missing(name)):
            problems.append(f"{engine} expects weight {name!r} (shape {shape}) but no trainer tensor maps to it: "
                            f"it would keep stale values")
    return problems


# ----------------------------------------------------------------------------------------------
# topology: who gathers, who sends, who talks to the engines
# ----------------------------------------------------------------------------------------------
class MegatronTopology:
    """Ranks and groups from megatron's parallel_state and torch.distributed.

    Stage leader: TP rank 0 of data-parallel (and context-parallel) replica 0 of each PP stage.
    Controller: global rank 0 (the leader of PP stage 0), the only rank that calls the sinks.
    Control messages (plans, verdicts) use a gloo group over all ranks, created lazily.
    """

    def __init__(self, shm_gather: bool | None = None):
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.shm_gather = shm_gather
        self._shm = None  # same-host shared-memory gather state (see prepare)
        self._packs = None
        self._last_in_pack = False
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.active = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        self.is_leader = self.active and self.tp_rank == 0
        self.controller = 0
        self.is_controller = self.rank == self.controller
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_src = ps.get_tensor_model_parallel_src_rank()
        self._ctrl = None

    def _control_group(self):
        if self._ctrl is None:
            self._ctrl = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        return self._ctrl

    def init_collective(self) -> None:
        """Collective over all ranks: create the control group (call once, everyone)."""
        self._control_group()

    SHM_STAGING_BYTES = 128 * 1024 * 1024

    def prepare(self, entries: Sequence[_Entry]) -> None:
        """Collective over the TP group of every active rank, before the gathers of a sync.

        CPU tensors with all TP ranks on one host: set up a shared-memory gather.  gloo moves
        data over loopback TCP at a few hundred MB/s on a busy host; instead each non-leader
        copies its shards into a /dev/shm staging file the leader has mapped (one memcpy on each
        side), packing consecutive parameters up to `SHM_STAGING_BYTES` (or the largest shard),
        and the ranks exchange two tiny barriers per pack.  Used when `shm_gather` is None (auto)
        or True; False keeps torch.distributed `gather` (gloo / NCCL).
        """
        self._packs = None
        if self.tp_size == 1 or not self.active or self.shm_gather is False:
            return
        if {e.tensor.device.type for e in entries} - {"cpu"} or not os.path.isdir("/dev/shm"):
            return
        gathered = [(i, e.tensor.nbytes) for i, e in enumerate(entries) if GATHER_DIM[e.role.kind] is not None]
        if not gathered:
            return
        cap = max(max(n for _, n in gathered), min(sum(n for _, n in gathered), self.SHM_STAGING_BYTES))
        # deterministic packing, identical on every TP rank (same entries, same shard shapes)
        packs, cur, off = {}, [], 0
        for i, n in gathered:
            if cur and off + n > cap:
                cur, off = [], 0
            cur.append(i)
            packs[id(entries[i])] = (cur, off)
            off += n
        self._entries = entries
        if self._shm is None or self._shm["size"] < cap:
            hosts = [None] * self.tp_size
            dist.all_gather_object(hosts, self.hostname(), group=self.tp_group)
            if len(set(hosts)) > 1:
                self.shm_gather = False
                return
            name = None
            if self.tp_rank != 0:
                name = f"/dev/shm/rlhf_weight_bridge_{os.getpid()}_{self.rank}_{time.time_ns()}"
                with open(name, "wb") as f:
                    f.truncate(cap)
                staging = torch.from_file(name, shared=True, size=cap, dtype=torch.uint8)
            names = [None] * self.tp_size
            dist.all_gather_object(names, name, group=self.tp_group)
            state = {"size": cap}
            if self.tp_rank == 0:
                state["peers"] = [torch.from_file(n, shared=True, size=cap, dtype=torch.uint8) for n in names[1:]]
            else:
                state["staging"] = staging
            dist.barrier(group=self.tp_group)
            if name is not None:
                os.unlink(name)  # the mappings stay valid; nothing is left behind in /dev/shm
            self._shm = state
        self._packs = packs

    def gather(self, entry: _Entry, dim: int) -> list[torch.Tensor] | None:
        """TP shards of `entry.tensor` on the stage leader (rank order), None elsewhere.

        The leader calls `release_gather()` once it no longer needs the shards.
        """
        t = entry.tensor.detach().contiguous()
        if self.tp_size == 1:
            return [t]
        if self._packs is not None:
            pack, off = self._packs[id(entry)]
            first = self._entries[pack[0]] is entry
            if self.tp_rank != 0:
                if first:  # stage the whole pack, then wait until the leader has read it
                    staging = self._shm["staging"]
                    for i in pack:
                        e = self._entries[i]
                        src = e.tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                        _, o = self._packs[id(e)]
                        staging[o:o + src.numel()].copy_(src)
                    dist.barrier(group=self.tp_group)  # pack staged
                    dist.barrier(group=self.tp_group)  # leader done with it
                return None
            if first:
                dist.barrier(group=self.tp_group)
            self._last_in_pack = self._entries[pack[-1]] is entry
            return [t] + [p[off:off + t.nbytes].view(t.dtype).view(t.shape) for p in self._shm["peers"]]
        out = [torch.empty_like(t) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(t, gather_list=out, dst=self.tp_src, group=self.tp_group)
        return out

    def release_gather(self) -> None:
        """Leader: the shards of the last `gather` are no longer needed."""
        if self._packs is not None and self.tp_size > 1 and self._last_in_pack:
            dist.barrier(group=self.tp_group)

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self._control_group())
        return out

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=self.controller, group=self._control_group())
        return box[0]

    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t, dst=dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, src=src)

    def hostname(self) -> str:
        return socket.gethostname()


class SimulatedTPTopology:
    """One process simulating a TP group of ``len(rank_chunks)`` ranks at PP 1 (tests, debugging).

    `rank_chunks[r]` are the model chunks megatron TP rank r would hold; rank 0's chunks are the
    ones given to the bridge.  `gather` returns the same tensor from every simulated rank, so the
    bridge runs its real conversion and bucketing path without communication.
    """

    def __init__(self, rank_chunks: Sequence[Sequence[Any]]):
        self.rank_chunks = rank_chunks
        self.rank, self.world = 0, 1
        self.tp_size, self.tp_rank = len(rank_chunks), 0
        self.pp_size, self.pp_rank = 1, 0
        self.active = self.is_leader = self.is_controller = True
        self.controller = 0
        self._sd = [[unwrap_model(c).state_dict(keep_vars=True) for c in chunks] for chunks in rank_chunks]

    def init_collective(self) -> None:
        pass

    def prepare(self, entries) -> None:
        pass

    def gather(self, entry: _Entry, dim: int) -> list[torch.Tensor]:
        return [sd[entry.chunk_index][entry.local_name].detach() for sd in self._sd]

    def release_gather(self) -> None:
        pass

    def all_gather_object(self, obj) -> list:
        return [obj]

    def broadcast_object(self, obj):
        return obj

    def send(self, t, dst):  # pragma: no cover - single process
        raise AssertionError("no p2p in a simulated topology")

    recv = send

    def hostname(self) -> str:
        return socket.gethostname()


# ----------------------------------------------------------------------------------------------
# plans and results
# ----------------------------------------------------------------------------------------------
@dataclass
class StagePlan:
    """What one PP stage sends: its leader's global rank, tensors (target dtypes), buckets."""

    pp_rank: int
    leader: int
    metas: list[TensorMeta]
    buckets: list[BucketPlan]
    group_name: str | None = None
    master_address: str | None = None
    master_port: int | None = None


@dataclass
class SendPlan:
    """The validated plan of one sync: per-stage tensors and buckets (stage order = send order),
    names read back in check mode, size of each weight-update group (distributed transport)."""

    stages: list[StagePlan]
    check_names: list[str]
    group_world_size: int | None = None

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for s in self.stages for m in s.metas)

    @property
    def num_tensors(self) -> int:
        return sum(len(s.metas) for s in self.stages)


@dataclass
class CheckReport:
    """Result of check mode: which sent tensors were read back from the engine and agreed.

    What it verifies (honestly): for each checked name, SGLang's `get_weights_by_name` returns
    the first `rows` rows of the weight as held by engine TP rank 0 (column-parallel weights:
    rank 0's leading rows = the tensor's leading rows; row-parallel o_proj/down_proj: gathered
    full rows; replicated norms: full).  These are compared exactly with the same rows of the
    tensor the bridge sent.  Weights SGLang cannot read back that way (Qwen2 has no
    `get_weights_by_name`; k/v under KV-head replication report 0 rows) are `unverifiable`.
    """

    verified: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, float]] = field(default_factory=list)
    unverifiable: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class SyncStats:
    """Outcome of one `sync()` on this rank (byte counts are global; timings local)."""

    seconds: float = 0.0
    plan_seconds: float = 0.0
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    peak_extra_bytes: int = 0  # bucket buffers + gathered/converted tensors on this rank
    produce_seconds: float = 0.0  # this rank waiting for its own buckets (TP gather, convert, pack)
    receive_seconds: float = 0.0  # controller, colocated PP: receiving other stages' buckets
    deliver_seconds: float = 0.0  # engine calls / p2p sends / broadcasts (and waiting for the engines)
    finish_seconds: float = 0.0  # controller: end_weight_update + flush_cache on every engine
    skipped_buffers: list[str] = field(default_factory=list)
    check: CheckReport | None = None


# ----------------------------------------------------------------------------------------------
# the bridge
# ----------------------------------------------------------------------------------------------
class _Threaded:
    """Run an iterator in a daemon thread, one item ahead (exceptions re-raised in the consumer)."""

    _END = object()

    def __init__(self, it: Iterator):
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.t = threading.Thread(target=self._run, args=(it,), daemon=True)
        self.t.start()

    def _run(self, it):
        try:
            for x in it:
                self.q.put(x)
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            self.q.put(e)
            return
        self.q.put(self._END)

    def __iter__(self):
        while True:
            x = self.q.get()
            if x is self._END:
                return
            if isinstance(x, BaseException):
                raise x
            yield x


class WeightBridge:
    """Streams the actor's weights from megatron chunks into rollout engines (see module doc).

    Construct on EVERY trainer rank with the same arguments except `sinks`, which only the
    controller (global rank 0) passes: one engine handle or a list of them (WeightSink, or
    DistributedWeightSink for ``transport="distributed"``).

    Args:
        model_chunks: this rank's GPTModel chunks (DDP/Float16Module wrappers are fine).
        spec: the HFModelSpec of the model.
        sinks: engine handle(s) on the controller, None elsewhere.
        transport: ``"tensor"`` (colocated, update_weights_from_tensor) or ``"distributed"``
            (disaggregated broadcast over a weight-update group per PP stage).
        bucket_bytes: bucket size in bytes (default 512 MiB); a larger single tensor gets a
            bucket of its own.
        dtype: dtype sent to the engine; None = each weight's dtype in `expected_weights()` (so
            a bf16 engine receives bf16), falling back to the trainer dtype.
        overlap: convert bucket k+1 in a thread while bucket k is sent (2 buffers).
        name_map: hook mapping extra megatron names (e.g. persistent buffers) to HF tensors.
        check: None, ``"sample"`` (every tensor of the first and last layer and all non-layer
            tensors) or ``"all"``: read sent tensors back through `get_weights_by_name`
            (see CheckReport for what this verifies); a mismatch raises WeightBridgeError.
        check_rows: rows per tensor read back in check mode.
        allow_missing: predicate on engine weight names that may stay unsent.
        group_prefix, backend, master_address, timeout_s: distributed transport settings
            (backend None: nccl with CUDA, else gloo; master_address None: each stage leader's
            `gethostbyname(gethostname())`, where the engines reach its rendezvous store).
        topology: override (tests: SimulatedTPTopology); default MegatronTopology().
    """

    def __init__(self, model_chunks, spec: HFModelSpec, sinks=None, *, transport: str = "tensor",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype=None, overlap: bool = False,
                 name_map: NameMap | None = None, check: str | None = None, check_rows: int = 4,
                 allow_missing: Callable[[str], bool] | None = None, group_prefix: str = "weight_bridge",
                 backend: str | None = None, master_address: str | None = None, timeout_s: float = 1800.0,
                 topology=None):
        if transport not in ("tensor", "distributed"):
            raise ValueError(f"transport={transport!r}: use 'tensor' (colocated) or 'distributed' (broadcast)")
        if check not in (None, "sample", "all"):
            raise ValueError(f"check={check!r}: use None, 'sample' or 'all'")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.chunks = list(model_chunks)
        self.spec = spec
        self.topo = topology if topology is not None else MegatronTopology()
        if sinks is not None and not isinstance(sinks, (list, tuple)):
            sinks = [sinks]
        self.sinks = list(sinks or [])
        if self.topo.is_controller and not self.sinks:
            raise ValueError("the controller rank (global rank 0) must be given the engine handle(s) as `sinks`")
        if not self.topo.is_controller and self.sinks:
            raise ValueError(f"only global rank {self.topo.controller} may hold sinks (got some on rank {self.topo.rank})")
        for i, s in enumerate(self.sinks):
            need = _SINK_METHODS + (_DIST_SINK_METHODS if transport == "distributed" else ())
            missing = [m for m in need if not callable(getattr(s, m, None))]
            if missing:
                raise TypeError(f"sink {_sink_label(i, s)} lacks {missing} needed by transport={transport!r}")
        self.transport = transport
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = None if dtype is None else dtype_from_any(dtype)
        self.overlap = overlap
        self.name_map = name_map
        self.check = check
        self.check_rows = int(check_rows)
        self.allow_missing = allow_missing
        self.group_prefix = group_prefix
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.meter = MemoryMeter()
        self._expected: list[dict] | None = None
        self._groups_ready = False
        self._pg = None  # this leader's weight-update group (distributed transport)
        self._collective_ready = False
        self._times = {"produce": 0.0, "receive": 0.0, "deliver": 0.0}
        self._flushed: dict[int, bool] = {}
        self._flush_kwarg: dict[int, bool] = {}
        self.version = 0

    # ---- planning -------------------------------------------------------------------------
    def _expected_weights(self) -> list[dict]:
        if self._expected is None:
            self._expected = [_normalize_expected(s.expected_weights()) for s in self.sinks]
        return self._expected

    def refresh_expected(self) -> None:
        """Forget the cached `expected_weights()` (call after an engine restart)."""
        self._expected = None

    def _device(self) -> torch.device:
        for c in self.chunks:
            for p in unwrap_model(c).parameters():
                return p.device
        return torch.device("cpu")

    def _local_report(self, entries):
        """What this rank tells the controller in the plan phase."""
        if not self.topo.is_leader:
            return None
        rep = {"pp_rank": self.topo.pp_rank, "rank": self.topo.rank, "host": self.topo.hostname(),
               "tensors": [(n, s, dtype_name(d)) for n, s, d in plan_local_tensors(entries, self.spec, self.topo.tp_size)]}
        if self.transport == "distributed" and not self._groups_ready:
            with socket.socket() as s:
                s.bind(("", 0))
                rep["port"] = s.getsockname()[1]
            try:  # the address engines use to reach this leader's rendezvous store
                rep["addr"] = socket.gethostbyname(socket.gethostname())
            except OSError:
                rep["addr"] = "127.0.0.1"
        return rep

    def _controller_plan(self, reports: list) -> SendPlan:
        reports = [r for r in reports if r is not None]
        errors = [r["error"] for r in reports if "error" in r]
        if errors:
            raise WeightBridgeError("weight sync refused before sending anything: " + "; ".join(errors))
        by_stage = {}
        for r in reports:
            if r["pp_rank"] in by_stage:
                raise WeightBridgeError(f"two leaders for pipeline stage {r['pp_rank']}")
            by_stage[r["pp_rank"]] = r
        if 0 not in by_stage or by_stage[0]["rank"] != self.topo.controller:
            raise WeightBridgeError(f"global rank {self.topo.controller} must lead pipeline stage 0 "
                                    f"(tp rank 0, dp rank 0); megatron's rank order puts it there by default")
        stage_tensors = {p: r["tensors"] for p, r in by_stage.items()}
        problems = []
        expected = self._expected_weights()
        for i, (sink, exp) in enumerate(zip(self.sinks, expected)):
            problems += validate_against_expected(stage_tensors, exp, self.spec, _sink_label(i, sink), self.allow_missing)
        if problems:
            more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
            raise WeightBridgeError("weight sync refused before sending anything:\n  " + "\n  ".join(problems[:20]) + more)
        stages = []
        for p in sorted(by_stage):
            r = by_stage[p]
            metas = []
            for name, shape, src_dtype in r["tensors"]:
                dt = self.dtype or (expected[0][name][1] if expected and expected[0][name][1] is not None else None)
                metas.append(TensorMeta(name, tuple(shape), dt or dtype_from_any(src_dtype)))
            st = StagePlan(p, r["rank"], metas, plan_buckets(metas, self.bucket_bytes))
            if self.transport == "distributed":
                st.group_name = f"{self.group_prefix}_pp{p}"
                st.master_port = r.get("port")
                st.master_address = self.master_address or r.get("addr") or "127.0.0.1"
            stages.append(st)
        names = [m.name for s in stages for m in s.metas]
        if self.check == "all":
            check_names = names
        elif self.check == "sample":
            layer_ids = sorted({int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))})
            keep = {layer_ids[0], layer_ids[-1]} if layer_ids else set()
            check_names = [n for n in names if not (m := re.match(r"model\.layers\.(\d+)\.", n)) or int(m.group(1)) in keep]
        else:
            check_names = []
        world = None
        if self.transport == "distributed":
            world = 1 + sum(_sink_num_ranks(s) for s in self.sinks)
        return SendPlan(stages, check_names, world)

    def plan(self) -> SendPlan:
        """Collective: build and validate the send plan (no weights move). Raises WeightBridgeError
        on every rank when a name or shape does not match an engine."""
        return self._plan()[0]

    def _plan(self):
        if not self._collective_ready:
            self.topo.init_collective()
            self._collective_ready = True
        try:
            entries, skipped = local_entries(self.chunks, self.spec, self.name_map) if self.topo.active else ([], [])
            report = self._local_report(entries)
        except Exception as e:  # noqa: BLE001 - reported through the controller so no rank hangs
            entries, skipped = [], []
            report = {"error": f"rank {self.topo.rank}: {type(e).__name__}: {e}"}
        reports = self.topo.all_gather_object(report)
        verdict = None
        if self.topo.is_controller:
            try:
                verdict = self._controller_plan(reports)
            except Exception as e:  # noqa: BLE001 - every rank must learn about it
                verdict = e if isinstance(e, WeightBridgeError) else WeightBridgeError(f"{type(e).__name__}: {e}")
        verdict = self.topo.broadcast_object(verdict)
        if isinstance(verdict, BaseException):
            raise verdict
        return verdict, entries, skipped

    # ---- data -----------------------------------------------------------------------------
    def _hf_stream(self, entries: Sequence[_Entry]) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """(HF name, full tensor, owned) on the stage leader; the other TP ranks only take part in
        the gathers (they yield nothing).  owned=False: the tensor aliases model memory.

        Memory: the gathered shards and their converted copy coexist only while converting one
        parameter; the shards are dropped before the HF tensors are handed on.
        """
        topo = self.topo
        for e in entries:
            dim = GATHER_DIM[e.role.kind]
            if dim is None:
                if not topo.is_leader:
                    continue
                shards = [e.tensor.detach()]
            else:
                shards = topo.gather(e, dim)
                if not topo.is_leader:
                    continue
            gathered = sum(x.nbytes for x in shards) if dim is not None and topo.tp_size > 1 else 0
            try:
                with torch.no_grad():
                    outs = hf_tensors_from_shards(e.role, shards, self.spec)
            finally:
                if dim is not None:
                    topo.release_gather()  # every kind with a gather copies in hf_tensors_from_shards
            converted = 0 if dim is None else sum(t.nbytes for _, t in outs)
            self.meter.alloc(gathered + converted)
            del shards
            self.meter.free(gathered)
            try:
                while outs:
                    name, t = outs.pop(0)
                    yield name, t, dim is not None
                    del t
            finally:
                del outs
                self.meter.free(converted)

    def _own_buckets(self, stage: StagePlan, entries, pool: BufferPool):
        it = fill_buckets(self._hf_stream(entries), stage.buckets, pool)
        return self._timed(iter(_Threaded(it)) if self.overlap else it, "produce")

    def _timed(self, it: Iterator, key: str) -> Iterator:
        """Charge the time spent waiting for each item of `it` to self._times[key]."""
        while True:
            t0 = time.perf_counter()
            try:
                x = next(it)
            except StopIteration:
                self._times[key] += time.perf_counter() - t0
                return
            self._times[key] += time.perf_counter() - t0
            yield x

    def _record_samples(self, plan: SendPlan, bplan: BucketPlan, buf: torch.Tensor, samples: dict) -> None:
        if not plan.check_names:
            return
        wanted = set(plan.check_names)
        for name, view in bucket_views(buf, bplan):
            if name in wanted:
                rows = view.reshape(view.shape[0], -1)[: self.check_rows] if view.dim() > 1 else view[: self.check_rows]
                samples[name] = rows.detach().to("cpu", torch.float32).clone()

    def sync(self) -> SyncStats:
        """Collective over every trainer rank: push the current weights into every engine.

        Returns SyncStats.  Raises WeightBridgeError on every rank when the plan does not match
        an engine (nothing sent), when an engine call fails (the engine may then hold a mix of
        old and new weights: sync again), or when check mode finds a mismatch.
        """
        t0 = time.perf_counter()
        self.meter.reset_peak()
        self._times = {"produce": 0.0, "receive": 0.0, "deliver": 0.0}
        self._flushed: dict[int, bool] = {}  # sink index -> its cache was flushed by an update call
        plan, entries, skipped = self._plan()
        if self.topo.active:
            self.topo.prepare(entries)
        stats = SyncStats(plan_seconds=time.perf_counter() - t0, bytes=plan.total_bytes,
                          num_tensors=plan.num_tensors, num_buckets=sum(len(s.buckets) for s in plan.stages),
                          skipped_buffers=skipped)
        topo = self.topo
        if self.transport == "distributed" and not self._groups_ready:
            self._setup_groups(plan)
        # open the session on every engine, then tell everyone whether to go
        go = None
        if topo.is_controller:
            opened = []
            try:
                for i, s in enumerate(self.sinks):
                    _check_result(s.begin_weight_update(), f"{_sink_label(i, s)}.begin_weight_update")
                    opened.append(s)
            except Exception as e:  # noqa: BLE001
                go = e if isinstance(e, WeightBridgeError) else WeightBridgeError(f"{type(e).__name__}: {e}")
                for s in opened:  # leave no session open behind us
                    try:
                        s.end_weight_update()
                    except Exception:  # noqa: BLE001
                        pass
        go = topo.broadcast_object(go)
        if isinstance(go, BaseException):
            raise go
        error = None
        samples: dict[str, torch.Tensor] = {}
        if topo.active:
            my_stage = next((s for s in plan.stages if s.pp_rank == topo.pp_rank), None)
            # buffers as large as the largest bucket that fits bucket_bytes; a bigger single tensor
            # travels in its own memory (see fill_buckets)
            fitting = [b.nbytes for s in plan.stages for b in s.buckets if b.nbytes <= self.bucket_bytes]
            pool = BufferPool(max(fitting or [1]), count=2 if self.overlap else 1, device=self._device(),
                              meter=self.meter, shared=self.transport == "tensor")
            try:
                if self.transport == "tensor":
                    error = self._run_tensor(plan, my_stage, entries, pool, samples)
                else:
                    error = self._run_distributed(plan, my_stage, entries, pool, samples)
            except Exception as e:  # noqa: BLE001 - reported below so every rank raises the same error
                error = f"rank {topo.rank}: {type(e).__name__}: {e}"
            finally:
                pool.close()
        t_finish = time.perf_counter()
        if topo.is_controller:
            for i, s in enumerate(self.sinks):
                try:
                    _check_result(s.end_weight_update(), f"{_sink_label(i, s)}.end_weight_update")
                    if not self._flushed.get(i):
                        _check_result(s.flush_cache(), f"{_sink_label(i, s)}.flush_cache")
                except Exception as e:  # noqa: BLE001
                    error = error or f"{type(e).__name__}: {e}"
        stats.finish_seconds = time.perf_counter() - t_finish
        # everyone learns the outcome; samples for check mode travel with it
        outcome = topo.all_gather_object((error, samples if plan.check_names else None))
        errors = [e for e, _ in outcome if e]
        if errors:
            raise WeightBridgeError("weight sync failed: " + "; ".join(dict.fromkeys(errors)))
        if plan.check_names:
            verdict = None
            if topo.is_controller:
                all_samples = {}
                for _, smp in outcome:
                    all_samples.update(smp or {})
                stats.check = self._verify(plan, all_samples)
                if stats.check.mismatched:
                    verdict = WeightBridgeError(f"engine weights differ from what was sent: {stats.check.mismatched[:10]}")
            verdict = topo.broadcast_object(verdict)
            if verdict is not None:
                raise verdict
        self.version += 1
        stats.peak_extra_bytes = self.meter.peak
        stats.produce_seconds, stats.receive_seconds = self._times["produce"], self._times["receive"]
        stats.deliver_seconds = self._times["deliver"]
        stats.seconds = time.perf_counter() - t0
        return stats

    # ---- colocated ------------------------------------------------------------------------
    def _deliver(self, named: list[tuple[str, torch.Tensor]], last: bool) -> None:
        t0 = time.perf_counter()
        try:
            for i, s in enumerate(self.sinks):
                kw = self._flush_kw(i, s.update_weights_from_tensor, last)
                _check_result(s.update_weights_from_tensor(named, **kw), f"{_sink_label(i, s)}.update_weights_from_tensor")
                if kw.get("flush_cache"):
                    self._flushed[i] = True
        finally:
            self._times["deliver"] += time.perf_counter() - t0

    def _flush_kw(self, i: int, method, last: bool) -> dict:
        """Flush the engine's cache once per sync, with the last update when the sink's method
        takes `flush_cache` (inside the update call SGLang flushes at once; a separate
        `flush_cache()` request costs ~0.6 s on the CPU engine).  Otherwise `flush_cache()` is
        called at the end."""
        if i not in self._flush_kwarg:
            self._flush_kwarg[i] = _accepts_kwarg(method, "flush_cache")
        return {"flush_cache": last} if self._flush_kwarg[i] else {}

    def _run_tensor(self, plan: SendPlan, my_stage, entries, pool: BufferPool, samples) -> str | None:
        topo = self.topo
        error = None
        if topo.is_controller:
            for stage in plan.stages:
                if stage.leader == topo.rank:
                    source = self._own_buckets(stage, entries, pool)
                else:
                    source = self._timed(self._recv_buckets(stage, pool), "receive")
                for bplan, slot, buf in source:
                    try:
                        self._record_samples(plan, bplan, buf, samples)
                        if error is None:  # after a failure keep draining so no sender blocks forever
                            self._deliver(bucket_views(buf, bplan),
                                          last=stage is plan.stages[-1] and bplan is stage.buckets[-1])
                        faults.maybe_fail("sync_weights", last=stage is plan.stages[-1] and bplan is stage.buckets[-1])
                    except Exception as e:  # noqa: BLE001
                        error = f"{type(e).__name__}: {e}"
                    finally:
                        pool.release(slot)
        elif topo.is_leader:
            for bplan, slot, buf in self._own_buckets(my_stage, entries, pool):
                t1 = time.perf_counter()
                try:
                    topo.send(buf, topo.controller)
                finally:
                    pool.release(slot)
                    self._times["deliver"] += time.perf_counter() - t1
        else:
            for _ in self._hf_stream(entries):  # gathers only
                pass
        return error

    def _recv_buckets(self, stage: StagePlan, pool: BufferPool):
        for bplan in stage.buckets:
            slot, buf = pool.acquire(bplan.nbytes)
            try:
                self.topo.recv(buf, stage.leader)
            except BaseException:
                pool.release(slot)
                raise
            yield bplan, slot, buf

    # ---- disaggregated --------------------------------------------------------------------
    def _setup_groups(self, plan: SendPlan) -> None:
        """Create one weight-update group per PP stage: its leader is rank 0, engine i's TP ranks
        follow at offset 1 + sum of the previous engines' sizes."""
        topo = self.topo
        timeout = datetime.timedelta(seconds=self.timeout_s)

        def own_side(stage):
            from sglang.srt.utils.common import init_custom_process_group

            return init_custom_process_group(backend=self.backend,
                                             init_method=f"tcp://{stage.master_address}:{stage.master_port}",
                                             world_size=plan.group_world_size, rank=0, group_name=stage.group_name,
                                             timeout=timeout)

        error = None
        if topo.is_controller:
            for stage in plan.stages:
                results, threads, offset = {}, [], 1
                for i, s in enumerate(self.sinks):
                    kw = dict(master_address=stage.master_address, master_port=stage.master_port, rank_offset=offset,
                              world_size=plan.group_world_size, group_name=stage.group_name, backend=self.backend)

                    def call(i=i, s=s, kw=kw):
                        try:
                            results[i] = s.init_weights_update_group(**kw)
                        except Exception as e:  # noqa: BLE001
                            results[i] = (False, f"{type(e).__name__}: {e}")

                    threads.append(threading.Thread(target=call, daemon=True))
                    offset += _sink_num_ranks(s)
                for t in threads:
                    t.start()
                if stage.leader == topo.rank:
                    self._pg = own_side(stage)
                for t in threads:
                    t.join()
                for i, s in enumerate(self.sinks):
                    try:
                        _check_result(results.get(i), f"{_sink_label(i, s)}.init_weights_update_group({stage.group_name})")
                    except WeightBridgeError as e:
                        error = error or str(e)
        elif topo.is_leader:
            stage = next(s for s in plan.stages if s.pp_rank == topo.pp_rank)
            self._pg = own_side(stage)
        error = topo.broadcast_object(error)
        if error:
            raise WeightBridgeError(error)
        self._groups_ready = True
        self._group_plan = {s.pp_rank: s.group_name for s in plan.stages}

    def _broadcast_bucket(self, bplan: BucketPlan, buf: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for _name, view in bucket_views(buf, bplan):
            dist.broadcast(view, src=0, group=self._pg)
        self._times["deliver"] += time.perf_counter() - t0

    def _run_distributed(self, plan: SendPlan, my_stage, entries, pool: BufferPool, samples) -> str | None:
        topo = self.topo
        error = None
        if topo.is_controller:
            for stage in plan.stages:
                own = self._own_buckets(stage, entries, pool) if stage.leader == topo.rank else None
                for bplan in stage.buckets:
                    handles = []
                    try:
                        if error is None:
                            for i, s in enumerate(self.sinks):
                                last = stage is plan.stages[-1] and bplan is stage.buckets[-1]
                                kw = self._flush_kw(i, s.update_weights_from_distributed_async, last)
                                handles.append((i, s, s.update_weights_from_distributed_async(
                                    bplan.names, [dtype_name(m.dtype) for m in bplan.metas],
                                    [list(m.shape) for m in bplan.metas], stage.group_name, **kw)))
                                if kw.get("flush_cache"):
                                    self._flushed[i] = True
                    except Exception as e:  # noqa: BLE001
                        error = f"{type(e).__name__}: {e}"
                    if own is not None:
                        _, slot, buf = next(own)
                        try:
                            self._record_samples(plan, bplan, buf, samples)
                            if handles:  # engines that accepted the request are waiting for the data
                                self._broadcast_bucket(bplan, buf)
                        finally:
                            pool.release(slot)
                    t_wait = time.perf_counter()
                    for i, s, h in handles:
                        try:
                            _check_result(h.wait() if hasattr(h, "wait") else h,
                                          f"{_sink_label(i, s)}.update_weights_from_distributed")
                        except Exception as e:  # noqa: BLE001
                            error = error or f"{type(e).__name__}: {e}"
                    self._times["deliver"] += time.perf_counter() - t_wait
                if own is not None:
                    for _ in own:  # exhaust (raises if the stream disagrees with the plan)
                        pass
        elif topo.is_leader:
            for bplan, slot, buf in self._own_buckets(my_stage, entries, pool):
                try:
                    self._record_samples(plan, bplan, buf, samples)
                    self._broadcast_bucket(bplan, buf)
                finally:
                    pool.release(slot)
        else:
            for _ in self._hf_stream(entries):
                pass
        return error

    # ---- check mode -----------------------------------------------------------------------
    def _verify(self, plan: SendPlan, samples: Mapping[str, torch.Tensor]) -> CheckReport:
        rep = CheckReport()
        for name in plan.check_names:
            sent = samples.get(name)
            for i, s in enumerate(self.sinks):
                label = f"{_sink_label(i, s)}:{name}"
                getter = getattr(s, "get_weights_by_name", None)
                if getter is None or sent is None:
                    rep.unverifiable.append((label, "engine has no get_weights_by_name" if getter is None else "not sampled"))
                    continue
                try:
                    got = getter(name, truncate_size=self.check_rows)
                except Exception as e:  # noqa: BLE001
                    rep.unverifiable.append((label, f"{type(e).__name__}: {e}"))
                    continue
                if got is None:
                    rep.unverifiable.append((label, "engine returned None (not supported for this model)"))
                    continue
                got = torch.as_tensor(got, dtype=torch.float32)
                if got.numel() == 0:
                    rep.unverifiable.append((label, "engine returned 0 rows (e.g. k/v under KV-head replication)"))
                    continue
                got = got.reshape(got.shape[0], -1) if sent.dim() > 1 else got.reshape(-1)
                n = min(got.shape[0], sent.shape[0])
                if got.shape[1:] != sent.shape[1:] or n == 0:
                    rep.mismatched.append((label, float("inf")))
                    continue
                diff = (got[:n] - sent[:n]).abs().max().item()
                (rep.verified.append(label) if diff == 0.0 else rep.mismatched.append((label, diff)))
        return rep

    def close(self) -> None:
        """Tear down this rank's weight-update group and ask the engines to drop theirs."""
        if self._pg is not None:
            try:
                dist.destroy_process_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        if self.topo.is_controller and self._groups_ready:
            for s in self.sinks:
                destroy = getattr(s, "destroy_weights_update_group", None)
                if destroy is not None:
                    for name in self._group_plan.values():
                        try:
                            destroy(name)
                        except Exception:  # noqa: BLE001
                            pass
        self._groups_ready = False


# ----------------------------------------------------------------------------------------------
# a fake engine (tests, dry runs)
# ----------------------------------------------------------------------------------------------
class InMemorySink:
    """A WeightSink that keeps what it receives: `received[name]` (a clone), `calls` (method
    names in order, with the names of each update).  Mimics SGLang's checks: refuses updates
    outside a begin/end session, raises on a wrong shape, ignores (and records in `ignored`)
    unknown names.  `expected_weights()` returns the `expected` mapping given."""

    def __init__(self, expected: Mapping, name: str = "fake_engine", tp_size: int = 1):
        self._expected = _normalize_expected(expected)
        self.name = name
        self.tp_size = tp_size
        self.received: dict[str, torch.Tensor] = {}
        self.ignored: list[str] = []
        self.calls: list[tuple[str, Any]] = []
        self.in_session = False

    def expected_weights(self):
        self.calls.append(("expected_weights", None))
        return dict(self._expected)

    def begin_weight_update(self):
        self.calls.append(("begin_weight_update", None))
        if self.in_session:
            return False, "a weight-update session is already open"
        self.in_session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update", None))
        ok = self.in_session
        self.in_session = False
        return ok, "" if ok else "no session"

    def update_weights_from_tensor(self, named_tensors):
        named_tensors = list(named_tensors)
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors]))
        if not self.in_session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        for n, t in named_tensors:
            if n not in self._expected:
                self.ignored.append(n)
                continue
            if tuple(t.shape) != self._expected[n][0]:
                raise RuntimeError(f"shape mismatch for {n}: {tuple(t.shape)} vs {self._expected[n][0]}")
            self.received[n] = t.detach().clone()
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache", None))
        return True

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        t = self.received.get(name)
        return None if t is None else t.float()[:truncate_size].tolist()
