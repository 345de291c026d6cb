"""LoRA adapters on the tensor-parallel linear layers of megatron-core's GPTModel.

A LoRA'd linear computes ``y = W x + (alpha / r) * B (A x)`` with the base weight W frozen and A [r, in],
B [out, r] trained (Hu et al. 2021).  Sharding mirrors the base layer, so no extra full-width collective is
needed (only rank-r activations travel):

* column-parallel (``linear_qkv``, ``linear_fc1``; W sharded on its output dim): A replicated over TP, B
  sharded on its output dim like W.  The r-wide ``A x`` is made a TP-parallel input the way the base layer
  treats its input: identity forward / all-reduce backward, or, under sequence parallelism, all-gathered along
  the sequence (reduce-scatter backward; A's gradient is then partial over sequence slices, so A is marked
  ``sequence_parallel`` and megatron's finalize_model_grads all-reduces it over TP, as it does the norms').
* row-parallel (``linear_proj``, ``linear_fc2``; W sharded on its input dim): A sharded on its input dim like
  W, B replicated.  The partial r-wide ``A x`` is all-reduced over TP (reduce-scattered along the sequence
  under sequence parallelism, B then marked ``sequence_parallel``), where the base layer reduces its output.

The adapters sit in one container per model chunk (``chunk.lora_adapters``, a child of the GPTModel), and
each runs from a forward hook on its base layer, so the base modules and their parameter names are unchanged:
HF import/export, the weight bridge and dist-checkpoint keys of the base weights stay as they are.  The
container's own checkpoint keys name global layer numbers (any TP/PP layout loads them).  Init is
layout-independent: A from a generator seeded by the adapter's global name (then sliced for this TP rank),
B zero, so the adapted model starts equal to the base one.

Megatron's TE spec fuses the input norm into ``linear_qkv`` / ``linear_fc1`` (TELayerNormColumnParallelLinear:
the layer sees the un-normed input); the hook then applies that norm itself (RMSNorm or LayerNorm from the
layer's own ``layer_norm_weight``/``layer_norm_bias``) before A.

MoE (Qwen3-MoE, Mixtral, DeepSeek-V3): the same target names adapt each routed expert's ``linear_fc1`` /
``linear_fc2`` (megatron's SequentialMLP, ``mlp.experts.local_experts.<i>``, the only experts module
parallel.models builds) and the shared experts' (``mlp.shared_experts``, a dense TP MLP), as PEFT's module-name
match selects ``experts.<e>.gate_proj`` etc. on HF Qwen3-MoE; the router is not adapted.  Each rank holds the
adapters of its local experts (EP), keyed by the global expert index.  Expert linears run with explicit expert
communication (the token dispatcher gathers tokens over the expert-TP group and reduces fc2's partial outputs), so
the expert adapters need no forward collective: column (fc1): A replicated over expert TP, B sharded like W;
row (fc2): A sharded like W, B replicated (its partial ``B A_r x_r`` summed by the dispatcher with the base
output).  The replicated tensor's gradient is then partial over the expert-TP ranks and is all-reduced there
(megatron's copy_to_tensor_model_parallel_region on the parameter).  The grouped-GEMM experts module
(TEGroupedMLP, ``moe_grouped_gemm``) is refused: apply_lora raises naming the fix.

The module imports no megatron at import time (the config validates target_modules with it).

Megatron-Bridge's PEFT (megatron.bridge.peft) implements the same idea but is not usable here: megatron-bridge
0.3.1 requires transformers<5 (we run 5.x), Transformer Engine, mamba-ssm and more at install time.
"""
from __future__ import annotations

import contextlib
import math
import re
import zlib
from dataclasses import dataclass

import torch

__all__ = ["LoRASettings", "MEGATRON_TARGETS", "resolve_targets", "apply_lora", "adapters_disabled",
           "lora_container", "adapted_layers", "LoRAAdapter", "CONTAINER"]

CONTAINER = "lora_adapters"  # the GPTModel child holding a chunk's adapters
COLUMN, ROW = "column", "row"
MEGATRON_TARGETS = {"linear_qkv": COLUMN, "linear_fc1": COLUMN, "linear_proj": ROW, "linear_fc2": ROW}
#: HF (PEFT) module names -> the megatron layer that fuses them
HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                  "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
_FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
_PATH = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention\.(linear_qkv|linear_proj)"
                   r"|mlp\.(?:shared_experts\.)?(linear_fc1|linear_fc2))$")
#: a routed expert's linear in megatron's SequentialMLP: layer, local expert index, name
_EXPERT_PATH = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
A_INITS = ("xavier", "kaiming")


@dataclass(frozen=True)
class LoRASettings:
    """rank r (> 0), alpha (the update is scaled by alpha / r), the megatron layers adapted (a subset of
    MEGATRON_TARGETS, see :func:`resolve_targets`), A's init ("xavier": verl/Megatron-Bridge's default, or
    "kaiming": PEFT's kaiming_uniform(a=sqrt(5))), and the seed of the init."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(MEGATRON_TARGETS)
    a_init: str = "xavier"
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def resolve_targets(target_modules) -> tuple[str, ...]:
    """Megatron layer names for `target_modules`: "all-linear" (every one of MEGATRON_TARGETS), or a list
    of HF/PEFT names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) and/or megatron names
    (linear_qkv, linear_proj, linear_fc1, linear_fc2).  Raises ValueError for an unknown name, or for part of
    a fused layer only (q_proj without k_proj/v_proj: megatron holds q, k, v in one linear_qkv, whose single
    adapter changes all three)."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return tuple(MEGATRON_TARGETS)
        target_modules = [target_modules]
    names = list(target_modules or [])
    if not names:
        raise ValueError("target_modules is empty; use all-linear or a list such as [q_proj, k_proj, v_proj, o_proj]")
    out = []
    for n in names:
        m = n if n in MEGATRON_TARGETS else HF_TO_MEGATRON.get(n)
        if m is None:
            raise ValueError(f"target_modules: {n!r} is not a linear layer LoRA can adapt here; use all-linear or "
                             f"names from {sorted(HF_TO_MEGATRON)} or {sorted(MEGATRON_TARGETS)}")
        if m in _FUSED and n not in MEGATRON_TARGETS and not set(_FUSED[m]) <= set(names):
            raise ValueError(f"target_modules: {n!r} without {[x for x in _FUSED[m] if x not in names]}: megatron "
                             f"fuses {list(_FUSED[m])} into {m}, which takes one adapter; list all of them")
        if m not in out:
            out.append(m)
    return tuple(m for m in MEGATRON_TARGETS if m in out)


def _init_a(shape: tuple[int, int], how: str, key: str, seed: int) -> torch.Tensor:
    """Full (unsharded) A [r, in], the same on every rank and layout: seeded by the adapter's global key."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    r, fan_in = shape
    if how == "xavier":
        bound = math.sqrt(6.0 / (r + fan_in))
    else:  # kaiming_uniform(a=sqrt(5)), PEFT's and nn.Linear's default: bound = 1 / sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LoRAAdapter(torch.nn.Module):
    """The adapter of one base layer: ``a`` [r, in_local], ``b`` [out_local, r] (local TP shards, see the
    module docstring for which is sharded); `kind` COLUMN or ROW; `key` its global name
    (``layers.<global layer index>.<path>``, its checkpoint key).  A routed expert's adapter has `expert_groups`
    (expert-TP group, expert-DP group): tp_rank / tp_size are then the expert-TP ones, the forward has no
    collective, the replicated tensor's gradient is summed over expert TP, and the parameters carry the base
    weight's ``allreduce`` flag (False under EP: megatron's DDP reduces them over expert DP)."""

    def __init__(self, base, kind: str, key: str, settings: LoRASettings, tp_rank: int, tp_size: int,
                 sequence_parallel: bool, device, dtype, expert_groups: tuple | None = None):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        out_local, in_local = base.weight.shape
        r = settings.rank
        full_in = in_local * tp_size if kind == ROW else in_local
        a = _init_a((r, full_in), settings.a_init, key, settings.seed)
        if kind == ROW:
            a = a.chunk(tp_size, dim=1)[tp_rank]
        self.a = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(out_local, r, device=device, dtype=dtype))
        sharded, replicated = (self.b, self.a) if kind == COLUMN else (self.a, self.b)
        set_tensor_model_parallel_attributes(sharded, True, 0 if kind == COLUMN else 1, 1)
        set_tensor_model_parallel_attributes(replicated, False, -1, 1)
        if sequence_parallel and tp_size > 1 and expert_groups is None:
            replicated.sequence_parallel = True  # partial over sequence slices: finalize_model_grads sums it
        if expert_groups is not None:
            for p in (self.a, self.b):
                p.allreduce = getattr(base.weight, "allreduce", True)
        self.kind, self.key, self.scaling = kind, key, settings.scaling
        self.sequence_parallel = sequence_parallel and tp_size > 1 and expert_groups is None
        self.tp_size, self.expert_groups = tp_size, expert_groups

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output for the base layer's input `x` [s(/tp), b, in_local] (already normed):
        [s(/tp), b, out_local], what is added to the base layer's output."""
        from megatron.core.tensor_parallel import mappings

        if self.expert_groups is not None:  # the token dispatcher does the expert-TP communication
            a, b = self.a.to(x.dtype), self.b.to(x.dtype)
            if self.tp_size > 1:  # the replicated tensor's gradient is partial over expert TP: sum it there
                if self.kind == COLUMN:
                    a = mappings.copy_to_tensor_model_parallel_region(a, group=self.expert_groups[0])
                else:
                    b = mappings.copy_to_tensor_model_parallel_region(b, group=self.expert_groups[0])
            return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * self.scaling
        h = torch.nn.functional.linear(x, self.a.to(x.dtype))
        if self.tp_size > 1:
            if self.kind == COLUMN:
                h = (mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
                     if self.sequence_parallel else mappings.copy_to_tensor_model_parallel_region(h))
            else:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                     else mappings.reduce_from_tensor_model_parallel_region(h))
        return torch.nn.functional.linear(h, self.b.to(x.dtype)) * self.scaling

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W + (alpha / r) B A`` for the base layer's local `weight` shard (same shape
        and dtype; computed in fp32); `weight` is not changed."""
        delta = (self.b.float() @ self.a.float()) * self.scaling
        return (weight.float() + delta).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None, **_):
        """dist_checkpointing entries of ``a`` and ``b`` keyed ``lora.<key>.a|b``: the TP-sharded one with its
        TP axis, the replicated one as a replica (global layer numbers: any TP/PP layout loads them; a routed
        expert's: its global expert index, sharded over expert TP, replicas over expert DP)."""
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        out = {}
        groups = {} if self.expert_groups is None else dict(zip(("tp_group", "dp_cp_group"), self.expert_groups))
        for name, axis in (("a", None if self.kind == COLUMN else 1), ("b", 0 if self.kind == COLUMN else None)):
            param, key = getattr(self, name), f"lora.{self.key}.{name}"
            out[f"{prefix}{name}"] = (make_sharded_tensor_for_checkpoint(param, key, **groups) if axis is None
                                      else make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=axis, **groups))
        return out


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """The input norm a TE LayerNorm-fused linear applies to `x` before its GEMM."""
    w = module.layer_norm_weight
    if getattr(module.config, "layernorm_zero_centered_gamma", False):
        w = w + 1
    eps = getattr(module, "eps", module.config.layernorm_epsilon)
    if getattr(module, "normalization", "RMSNorm") == "RMSNorm":
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w.to(x.dtype),
                                          module.layer_norm_bias.to(x.dtype), eps)


class LoRAContainer(torch.nn.Module):
    """A chunk's adapters (ModuleDict keyed by the base layer's local path, '.' -> '__') and the switch
    that turns them off (:func:`adapters_disabled`)."""

    def __init__(self):
        super().__init__()
        self.adapters = torch.nn.ModuleDict()
        self.enabled = True

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None, **_):
        """Every adapter's entries (:meth:`LoRAAdapter.sharded_state_dict`); without this megatron's default
        would save the TP-sharded tensors as replicas (rank 0's shard for all)."""
        out = {}
        for name, adapter in self.adapters.items():
            out.update(adapter.sharded_state_dict(f"{prefix}adapters.{name}."))
        return out


def lora_container(chunk) -> LoRAContainer | None:
    """The chunk's LoRAContainer (unwrapping DDP / Float16Module), or None without LoRA."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return getattr(chunk, CONTAINER, None)


def _hook(container: LoRAContainer, adapter: LoRAAdapter):
    fused_norm = None

    def hook(module, args, kwargs, output):
        nonlocal fused_norm
        if not container.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        if fused_norm is None:
            fused_norm = hasattr(module, "layer_norm_weight")
        if fused_norm:
            x = _norm(module, x)
        out, bias = output
        return out + adapter.delta(x), bias

    return hook


def apply_lora(chunks, settings: LoRASettings) -> int:
    """Freeze every parameter of `chunks` (GPTModel chunks, before DDP wrapping) and attach an adapter to each
    targeted linear layer: attention, dense MLP, shared experts and each local routed expert of megatron's
    SequentialMLP (``linear_fc1`` / ``linear_fc2`` select dense and expert MLPs alike); returns how many adapters
    this rank holds.  Needs megatron's model parallel state.  Raises ValueError for rank < 1, an unknown A init, a
    chunk that already has adapters, a grouped-GEMM experts module (TEGroupedMLP / GroupedMLP) under an fc target,
    or targets that match no layer."""
    from parallel import cpu_patches  # noqa: F401  (must precede megatron.core imports)
    from megatron.core import parallel_state as ps

    if settings.rank < 1:
        raise ValueError(f"lora rank={settings.rank}; use a positive rank (0 switches LoRA off)")
    if settings.a_init not in A_INITS:
        raise ValueError(f"lora A init {settings.a_init!r}; use one of {A_INITS}")
    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    count, seen, ep = 0, set(), None
    for chunk in chunks:
        if lora_container(chunk) is not None:
            raise ValueError("apply_lora: this model already has LoRA adapters")
        chunk.requires_grad_(False)
        container = LoRAContainer()
        for path, module in chunk.named_modules():
            if (type(module).__name__ in ("TEGroupedMLP", "GroupedMLP") and
                    {"linear_fc1", "linear_fc2"} & set(settings.targets)):
                raise ValueError(f"{path}: LoRA on grouped-GEMM experts ({type(module).__name__}) is not implemented; "
                                 f"build the experts as SequentialMLP (moe_grouped_gemm=False, parallel.models' "
                                 f"default) or drop gate_proj/up_proj/down_proj from target_modules")
            m, e = _PATH.match(path), _EXPERT_PATH.match(path)
            if m is None and e is None:
                continue
            name = (m.group(3) or m.group(4)) if m is not None else e.group(3)
            seen.add(name)
            if name not in settings.targets:
                continue
            layer = chunk.decoder.layers[int((m or e).group(1))]
            groups, ranks, sp = None, tp, bool(chunk.config.sequence_parallel)
            if m is not None:
                key = f"layers.{layer.layer_number - 1}.{m.group(2)}"
            else:  # a routed expert: global expert index, expert-TP sharding, no forward collective
                expert = layer.mlp.local_expert_indices[int(e.group(2))]
                key = f"layers.{layer.layer_number - 1}.mlp.experts.{expert}.{name}"
                if ep is None:
                    ep = ((ps.get_expert_tensor_parallel_group(), ps.get_expert_data_parallel_group()),
                          (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()))
                (groups, ranks), sp = ep, False
            if getattr(module, "gather_output", False):
                raise ValueError(f"{path}: a column-parallel layer with gather_output=True is not supported by LoRA")
            adapter = LoRAAdapter(module, MEGATRON_TARGETS[name], key, settings, *ranks, sp, module.weight.device,
                                  chunk.config.params_dtype, expert_groups=groups)
            container.adapters[path.replace(".", "__")] = adapter
            module.register_forward_hook(_hook(container, adapter), with_kwargs=True)
            count += 1
        setattr(chunk, CONTAINER, container)
    missing = [t for t in settings.targets if t not in seen]
    if missing and any(len(c.decoder.layers) for c in chunks):
        raise ValueError(f"LoRA targets {missing} match no layer of this model; drop them from target_modules")
    return count


def adapted_layers(chunk) -> dict:
    """{local path of the base layer: its LoRAAdapter} of one chunk ({} without LoRA)."""
    c = lora_container(chunk)
    return {} if c is None else {k.replace("__", "."): a for k, a in c.adapters.items()}


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Within the block the chunks compute as the base model (the adapters are skipped): the reference policy
    of a LoRA actor without a second copy of its weights."""
    containers = [c for c in map(lora_container, chunks) if c is not None]
    saved = [c.enabled for c in containers]
    for c in containers:
        c.enabled = False
    try:
        yield
    finally:
        for c, s in zip(containers, saved):
            c.enabled = s
