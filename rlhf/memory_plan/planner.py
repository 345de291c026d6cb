"""Per-GPU memory plan of a training run, phase by phase, before anything is allocated.

    plan = plan_memory(PlanInput(model=ModelShape.from_hf_config(config_json), ...))
    print(format_plan(plan))          # one row per phase: peak, headroom, biggest items, the knob to turn
    plan.fits                         # every phase fits and the engine gets a KV cache

`rlhf.memory_plan.from_config.plan_from_config(cfg, hf_config, ...)` builds the PlanInput from the
composed training config (``--plan-memory``).  The byte counts are in `rlhf.memory_plan.terms`.

Order of events modelled (colocated rollout, as `rlhf.setup` builds things):

1. build: actor / critic / reference (and on-policy distillation's teacher) weights, megatron DDP's fp32 grad
   buffers and the optimizer's fp32 main parameters (megatron allocates them when the optimizer is built).  Adam's
   moments do not exist yet (torch allocates them at the first step).
2. engine start: SGLang measures the FREE memory F (after the trainer's models, CUDA contexts
   and NCCL buffers) and keeps `mem_fraction_static * F` for its weights + KV cache
   (sglang 0.5.23 `measure_pre_model_load_memory` / `_profile_available_bytes`: KV = F * m - weights).
3. from step 1 on, Adam's moments exist for good, but the engine's share was fixed before them:
   generate and weight sync run with both (the phases that decide the fit).  During the trainer's
   phases the engine is released (SGLang memory saver) and keeps its context and runtime pool.
4. checkpoint save: megatron's distributed optimizer all-gathers its state over DP onto the GPU
   (:func:`save_gather_bytes`) with everything resident; the colocated engines are released around it
   (``PPOTrainer.save_context``), as in the trainer's phases.

Assumptions (each a PlanInput field): one engine rank per GPU; the trainer calls
`torch.cuda.empty_cache()` before the engine resumes (its cached activation blocks are not held);
CUDA context 0.75 GiB per process, SGLang's runtime pool (activations, CUDA graphs) 2 GiB; NCCL:
each communicator a trainer process creates (`terms.nccl_communicators`: one per process group it uses)
costs 544 MiB (2 ranks) or 688 MiB (more) on its GPU (NVIDIA/nccl#964); the world's exists from the start,
the others appear at their group's first collective, after the engine measured its free memory (counted
like Adam's moments).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlhf.memory_plan.terms import (NCCL_COMM_BYTES, NCCL_PAIR_COMM_BYTES, GiB, ModelShape, in_flight_micro_batches,
                                    kv_bytes_per_token, layer_activations, logits_bytes, model_params, nccl_communicators,
                                    oversize_sync_bytes, padded_vocab, stage_layers, stage_params,
                                    sync_broadcast_groups)

__all__ = ["GiB", "ModelShape", "Layout", "Role", "Workload", "EngineSetup", "PlanInput", "Item", "Phase",
           "MemoryPlan", "plan_memory", "format_plan", "communicators", "save_gather_bytes"]


@dataclass(frozen=True)
class Layout:
    """Trainer parallelism (megatron): dp = world / (tp * cp * pp); cp: context parallel (each rank holds
    1/cp of every sequence's tokens and activations)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    ep: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    cp: int = 1


@dataclass(frozen=True)
class Role:
    """One model the trainer holds: actor, critic (value head), reference or the on-policy distillation teacher
    (frozen, weights only).  A teacher has its own `model` and may have its own `layout` (a megatron grid over the
    trainer's ranks, rlhf.workers.teacher; its stages need not line up with the trainer's: its worst stage counts
    on every rank), with `micro_batch` its log-prob micro batch."""

    name: str
    trainable: bool = True
    distributed_optimizer: bool = False
    micro_batch: int = 1  # sequences per training micro batch
    num_micro_batches: int = 1  # per optimizer step on this rank (PP in-flight count)
    entropy: bool = True  # the update computes the entropy (PPO actor)
    # parts moved to the host between the phases that use them (parallel.offload: params, grads, optimizer): on
    # the device only in the role's own phases (and the actor's weights in the weight sync)
    offload: tuple[str, ...] = ()
    optimizer_host_fraction: float = 0.0  # megatron's optimizer_cpu_offload: this share of the state stays on host
    grad_bytes: int = 4  # main_grads_dtype (fp32: grad_reduce_in_fp32)
    main_param_bytes: int = 4  # main_params_dtype
    adam_bytes: int = 8  # exp_avg_dtype + exp_avg_sq_dtype
    model: ModelShape | None = None  # None: the plan's model
    layout: Layout | None = None  # None: the trainer's grid

    @property
    def value_head(self) -> bool:
        return self.name == "critic"


@dataclass(frozen=True)
class Workload:
    seq_length: int  # prompt + response tokens
    log_prob_micro_batch: int = 1  # old/ref log-probs and values
    temperature: float = 1.0


@dataclass(frozen=True)
class EngineSetup:
    """SGLang engines (rollout)."""

    tp: int = 1
    num_engines: int = 1
    mem_fraction_static: float = 0.5
    weight_bytes: int = 2
    kv_bytes: int = 2
    colocated: bool = True
    memory_saver: bool = True  # released during the trainer's phases
    release_for_save: bool = True  # released around a checkpoint save too (the trainer's save_checkpoint hook)
    runtime_bytes: float = 2 * GiB
    sync_bucket_bytes: float = 512 << 20


@dataclass(frozen=True)
class PlanInput:
    model: ModelShape
    layout: Layout
    roles: tuple[Role, ...]
    workload: Workload
    gpu_bytes: float = 80 * GiB
    num_gpus: int = 1
    engine: EngineSetup | None = None
    params_bytes: int = 2  # bf16
    recompute: str | None = None
    flash_attention: bool = True  # Transformer Engine spec (False: megatron's local spec)
    fused_adam: bool = True  # TE/Apex FusedAdam (False: torch Adam, foreach on CUDA: one fp32 temp per param)
    cuda: bool = True  # False: CPU run (no contexts, per-parameter Adam temporaries)
    fused_swiglu: bool = True  # megatron's bias_activation_fusion (on with TE; needs triton + a C compiler)
    divisible_by: int = 128
    cuda_context_bytes: float = 0.75 * GiB
    nccl_comm_bytes: float = NCCL_COMM_BYTES  # per communicator of more than 2 ranks, on each member's GPU
    nccl_pair_comm_bytes: float = NCCL_PAIR_COMM_BYTES  # per communicator of 2 ranks
    trainer_empty_cache: bool = True  # False: the trainer's cached activation blocks stay reserved while generating


@dataclass(frozen=True)
class Item:
    name: str
    bytes: float
    torch: bool = True  # counted by the trainer's torch allocator (torch.cuda.max_memory_allocated)


@dataclass
class Phase:
    name: str
    items: list[Item]
    knob: str
    stage: int = 0

    @property
    def peak(self) -> float:
        return sum(i.bytes for i in self.items)

    @property
    def torch_peak(self) -> float:
        """What `torch.cuda.max_memory_allocated` of the trainer process should read in this phase."""
        return sum(i.bytes for i in self.items if i.torch)


@dataclass
class MemoryPlan:
    gpu_bytes: float
    phases: list[Phase]
    problems: list[str] = field(default_factory=list)
    engine_free_at_start: float | None = None
    engine_static: float | None = None
    kv_cache_bytes: float | None = None
    kv_cache_tokens: float | None = None
    max_mem_fraction_static: float | None = None
    # colocated weight sync: the bucket copy on each engine GPU other than a stage leader's (bytes; a leader's GPU,
    # in phase "weight sync", holds more)
    sync_copy_bytes: float | None = None
    summary: str = ""

    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r}; phases: {[p.name for p in self.phases]}")

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.peak)

    @property
    def fits(self) -> bool:
        return not self.problems and all(p.peak <= self.gpu_bytes for p in self.phases)

    def knobs(self) -> list[str]:
        """One line per phase that does not fit, plus the engine problems."""
        return [f"{p.name}: needs {p.peak / GiB:.1f} GiB of {self.gpu_bytes / GiB:.1f}; {p.knob}"
                for p in self.phases if p.peak > self.gpu_bytes] + list(self.problems)


def _own(inp: PlanInput, role: Role) -> PlanInput:
    """`inp` with `role`'s own model, grid and log-prob micro batch (the teacher's), else `inp`."""
    if role.model is None and role.layout is None:
        return inp
    return replace(inp, model=role.model or inp.model, layout=role.layout or inp.layout,
                   workload=replace(inp.workload, log_prob_micro_batch=role.micro_batch))


def _role_static(inp: PlanInput, role: Role, stage: int) -> dict[str, float]:
    """weights / grads / main params / Adam moments of `role` on one rank of `stage`."""
    if role.layout is not None:  # a grid of its own: its largest stage, whatever the trainer's stage of the rank
        own, plain = _own(inp, role), replace(role, model=None, layout=None)
        return max((_role_static(own, plain, s) for s in range(role.layout.pp)), key=lambda d: d["weights"])
    inp = _own(inp, role)
    lay = inp.layout
    layers = stage_layers(inp.model.num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    dense_mlp = max(0, min(layers[stage], inp.model.dense_layers - sum(layers[:stage]))) if inp.model.num_experts else 0
    dense, expert = stage_params(inp.model, lay.tp, layers[stage], stage == 0, stage == lay.pp - 1,
                                 value_head=role.value_head, pp=lay.pp, ep=lay.ep, divisible_by=inp.divisible_by,
                                 dense_mlp_layers=dense_mlp)
    params = dense + expert
    out = {"weights": params * inp.params_bytes}
    if role.trainable:
        edp = max(1, lay.dp // lay.ep)  # expert data parallel: world / (etp * ep * pp), etp = tp
        shard = (dense / lay.dp + expert / edp) if role.distributed_optimizer else params
        out["grads"] = params * role.grad_bytes  # DDP grad buffer, fp32 unless main_grads_dtype=bf16
        on_device = 1.0 - role.optimizer_host_fraction  # megatron's HybridDeviceOptimizer keeps the rest on host
        out["main params"] = shard * role.main_param_bytes * on_device if inp.params_bytes < 4 else 0.0
        out["adam"] = shard * role.adam_bytes * on_device
        out["_optimizer_params"] = shard
        out["_dense"], out["_expert"], out["_edp"] = dense, expert, edp
        vocab = padded_vocab(inp.model.vocab_size, inp.divisible_by, lay.tp)
        out["_max_param"] = vocab / lay.tp * inp.model.hidden_size  # the largest tensor: embedding / LM head
    return out


#: which offload part (parallel.offload.PARTS) each static item of a role belongs to
PART_OF = {"weights": "params", "grads": "grads", "main params": "optimizer", "adam": "optimizer"}


def _resident(role: Role, kind: str) -> bool:
    return PART_OF[kind] not in role.offload


def _loaded(role: Role, static: dict, parts=("params", "grads", "optimizer")) -> list[Item]:
    """The offloaded items of `role` its phase loads back (`parts`)."""
    return [Item(f"{role.name} {k} (loaded from host)", v) for k, v in static.items()
            if k in PART_OF and v and PART_OF[k] in role.offload and PART_OF[k] in parts]


def _seq(inp: PlanInput) -> int:
    """Tokens per sequence on one rank: padded as parallel.forward pads, then 1/cp of them."""
    from parallel.context_parallel import seq_length_multiple

    lay = inp.layout
    multiple = seq_length_multiple(lay.cp, lay.tp, lay.sequence_parallel)
    return -(-inp.workload.seq_length // multiple) * multiple // lay.cp


def _acts(inp: PlanInput, micro_batch: int):
    return layer_activations(inp.model, _seq(inp), micro_batch, inp.layout.tp,
                             sequence_parallel=inp.layout.sequence_parallel and inp.layout.tp > 1,
                             act_bytes=inp.params_bytes, flash_attention=inp.flash_attention, recompute=inp.recompute,
                             fused_norm=inp.cuda, fused_swiglu=inp.fused_swiglu)


def _forward_peak(inp: PlanInput, role: Role, stage: int) -> float:
    """No-grad forward of one log-prob micro batch: the biggest of a layer's intermediates and the logits."""
    inp, stage = _own(inp, role), stage if role.layout is None else role.layout.pp - 1  # own grid: its worst stage
    micro = inp.workload.log_prob_micro_batch
    layer = _acts(inp, micro).forward_transient
    if stage != inp.layout.pp - 1 or role.value_head:
        return layer
    logits = logits_bytes(inp.model, _seq(inp) * micro, inp.layout.tp, act_bytes=inp.params_bytes, entropy=False,
                          temperature=inp.workload.temperature, divisible_by=inp.divisible_by, no_grad_seq=_seq(inp))
    return max(layer, logits)


def _train_peak(inp: PlanInput, role: Role, stage: int) -> tuple[float, float]:
    """(stored activations of the in-flight micro batches, the larger of the logits and the layer backward peaks)."""
    lay = inp.layout
    layers = stage_layers(inp.model.num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)[stage]
    acts = _acts(inp, role.micro_batch)
    in_flight = in_flight_micro_batches(lay.pp, stage, role.num_micro_batches, lay.vpp)
    stored = acts.stored * layers * in_flight
    x, e, h = _seq(inp) * role.micro_batch, inp.params_bytes, inp.model.hidden_size
    t_sp = lay.tp if lay.sequence_parallel else 1
    layer_bwd = acts.backward_transient + (acts.full_layer if inp.recompute == "full" else 0.0)
    top = 0.0
    if stage == lay.pp - 1:
        final_norm = (2 * e if inp.flash_attention or inp.cuda else 8 + e) * x * h / t_sp  # norm in + LM head in
        top = final_norm
        if not role.value_head:
            top += logits_bytes(inp.model, x, lay.tp, act_bytes=e, entropy=role.entropy,
                                temperature=inp.workload.temperature, divisible_by=inp.divisible_by)
    return stored, max(top, layer_bwd)


def plan_memory(inp: PlanInput) -> MemoryPlan:
    """Estimate the per-GPU peak of every phase (worst pipeline stage per phase); see the module docstring.

    Returns a MemoryPlan: phases with their items (bytes) and the knob to turn when one does not fit;
    problems (engine weights above its share, a KV cache smaller than one sequence, more than one
    engine rank per GPU).  Pure arithmetic; raises ValueError for a bad recompute value.
    """
    phases: list[Phase] = []
    problems: list[str] = []
    eng = inp.engine
    ctx0 = lambda stage: _context(inp, stage, later=False)  # noqa: E731 - at build and engine start
    ctx = lambda stage: _context(inp, stage, later=True)  # noqa: E731 - from the first step on
    plan = MemoryPlan(gpu_bytes=inp.gpu_bytes, phases=phases, problems=problems)
    stage_plans = []
    for stage in range(inp.layout.pp):
        statics = {r.name: _role_static(inp, r, stage) for r in inp.roles}
        roles = {r.name: r for r in inp.roles}
        at_start = [Item(f"{n} {k}", v) for n, s in statics.items() for k, v in s.items()
                    if k in ("weights", "grads", "main params") and v and _resident(roles[n], k)]
        adam = [Item(f"{n} adam", s["adam"]) for n, s in statics.items() if s.get("adam")
                and _resident(roles[n], "adam")]
        # a role with offload is built whole, then offloaded: the largest one is there for a moment
        # (Adam's moments appear at the first step, not at build)
        built = max(([i for i in _loaded(r, statics[r.name]) if not i.name.startswith(f"{r.name} adam")]
                     for r in inp.roles if r.offload), key=lambda i: sum(x.bytes for x in i), default=[])
        at_start_build = at_start + [Item(i.name.replace("(loaded from host)", "(while built, then offloaded)"),
                                          i.bytes) for i in built]
        stage_plans.append((stage, statics, at_start, adam, at_start_build))
    # the engine sizes itself against the fullest stage's free memory (SGLang takes the minimum over its ranks)
    stage, statics, at_start, adam, at_start_build = max(stage_plans, key=lambda sp: sum(i.bytes for i in sp[2]))
    engine_hold: list[Item] = []
    engine_released: list[Item] = []
    if eng is not None and eng.colocated:
        per_gpu = -(-eng.num_engines * eng.tp // max(inp.num_gpus, 1))
        if per_gpu > 1:
            problems.append(f"{eng.num_engines} engines x TP{eng.tp} need {per_gpu} engine ranks per GPU on "
                            f"{inp.num_gpus} GPUs; use rollout.num_engines * rollout.tensor_model_parallel_size "
                            f"<= {inp.num_gpus}")
        engine_ctx = Item("engine CUDA context", inp.cuda_context_bytes, False) if inp.cuda else None
        used = sum(i.bytes for i in at_start + ctx0(stage)) + (engine_ctx.bytes if engine_ctx else 0)
        free = inp.gpu_bytes - used
        weights = model_params(inp.model) * eng.weight_bytes / eng.tp
        static = eng.mem_fraction_static * free
        kv = static - weights
        plan.engine_free_at_start, plan.engine_static, plan.kv_cache_bytes = free, static, kv
        plan.kv_cache_tokens = max(kv, 0) / kv_bytes_per_token(inp.model, eng.tp, eng.kv_bytes)
        if kv <= 0:
            problems.append(f"engine weights ({weights / GiB:.1f} GiB per rank) exceed mem_fraction_static x free "
                            f"memory at engine start ({static / GiB:.1f} GiB): raise rollout.mem_fraction_static, "
                            f"or rollout.tensor_model_parallel_size")
        elif plan.kv_cache_tokens < inp.workload.seq_length:
            problems.append(f"KV cache holds {plan.kv_cache_tokens:.0f} tokens, less than one sequence "
                            f"({inp.workload.seq_length}): raise rollout.mem_fraction_static")
        engine_hold = ([engine_ctx] if engine_ctx else []) + [
            Item("engine weights + KV cache (mem_fraction_static x free at start)", static, False),
            Item("engine runtime pool (activations, CUDA graphs)", eng.runtime_bytes, False)]
        kept = Item("engine runtime pool (released: kept)", eng.runtime_bytes, False)
        engine_released = engine_hold if not eng.memory_saver else ([engine_ctx] if engine_ctx else []) + [kept]
        phases.append(Phase("build", ctx0(stage) + at_start_build, "use the distributed optimizer, raise tp/pp, or "
                            "drop a role", stage))
        phases.append(Phase("engine start", ctx0(stage) + at_start + engine_hold, "lower rollout.mem_fraction_static",
                            stage))
        phases.append(Phase("generate", ctx(stage) + at_start + adam + engine_hold, "", stage))
        # the stage leader's GPU (the worst): its bucket pool plus its receive buffer (a parameter's TP peers' part).
        # Every other engine GPU holds one copy of the pool (plan.sync_copy_bytes), which its engine rank maps:
        # the trainer rank there holds every stage's buckets (rlhf/weight_bridge/from_tensor.py; a stage leader
        # that also holds uses its one pool), with or without expert parallelism
        sync = [Item("weight sync buckets on the stage leader's GPU (gathered + packed)", 2 * eng.sync_bucket_bytes)]
        lay, m = inp.layout, inp.model
        leader_big, holder_big = oversize_sync_bytes(vocab=m.vocab_size, hidden=m.hidden_size, tp=lay.tp,
                                                     divisible_by=inp.divisible_by, params_bytes=inp.params_bytes,
                                                     weight_bytes=eng.weight_bytes,
                                                     bucket_bytes=eng.sync_bucket_bytes)
        if leader_big and (stage == 0 or (stage == lay.pp - 1 and not m.tie_word_embeddings)):
            sync.append(Item("weight sync: the embedding / LM head, a bucket of its own outside the pool (its TP "
                             "peers' rows received + the bucket)", leader_big))
        plan.sync_copy_bytes = eng.sync_bucket_bytes + holder_big
        actor = next((r for r in inp.roles if r.name == "actor"), None)
        sync += _loaded(actor, statics["actor"], ("params",)) if actor is not None else []  # offloaded: back for the sync
        phases.append(Phase("weight sync", ctx(stage) + at_start + adam + ([engine_ctx] if engine_ctx else []) +
                            [Item("engine weights (resumed before the KV cache)", weights, False)] + sync,
                            "lower rollout.weight_sync_bucket_mb", stage))
    else:
        phases.append(Phase("build", ctx0(stage) + at_start_build, "use the distributed optimizer, raise tp/pp, or "
                            "drop a role", stage))
        if eng is not None:
            free = inp.gpu_bytes - 2 * inp.cuda_context_bytes if inp.cuda else inp.gpu_bytes
            weights = model_params(inp.model) * eng.weight_bytes / eng.tp
            plan.engine_free_at_start, plan.engine_static = free, eng.mem_fraction_static * free
            plan.kv_cache_bytes = plan.engine_static - weights
            plan.kv_cache_tokens = max(plan.kv_cache_bytes, 0) / kv_bytes_per_token(inp.model, eng.tp, eng.kv_bytes)
    _trainer_phases(inp, plan, stage_plans, ctx, engine_released)
    _save_phase(inp, plan, stage_plans, ctx, engine_hold, engine_released)
    if eng is not None and eng.colocated:
        cached = 0.0
        if not inp.trainer_empty_cache:
            cached = max((p.torch_peak - sum(i.bytes for i in at_start + adam) for p in phases
                          if p.name.endswith(("log-probs", "values", "fwd/bwd", "step"))), default=0.0)
            for p in phases:
                if p.name in ("generate", "weight sync"):
                    p.items.append(Item("trainer cached blocks (no torch.cuda.empty_cache())", cached, False))
                    p.knob += "call torch.cuda.empty_cache() before the engine resumes; "
        free = plan.engine_free_at_start
        comms_later = sum(i.bytes for i in ctx(stage)) - sum(i.bytes for i in ctx0(stage))
        growth = sum(i.bytes for i in adam) + eng.runtime_bytes + cached + comms_later
        plan.max_mem_fraction_static = max(0.0, 1 - growth / free) if free > 0 else 0.0
        plan.phase("generate").knob += (
            f"lower rollout.mem_fraction_static to <= {plan.max_mem_fraction_static:.2f} (Adam's moments and most "
            f"NCCL communicators appear after the engine measured free memory), or use the distributed optimizer / "
            f"more DP")
    layout = inp.layout
    plan.summary = (f"{inp.gpu_bytes / GiB:.1f} GiB per GPU, {inp.num_gpus} GPUs; TP{layout.tp} PP{layout.pp} "
                    f"DP{layout.dp}{' EP' + str(layout.ep) if layout.ep > 1 else ''}"
                    f"{' SP' if layout.sequence_parallel else ''}; {'bf16' if inp.params_bytes == 2 else 'fp32'}; "
                    f"recompute={inp.recompute}; {'flash (TE)' if inp.flash_attention else 'unfused (local spec)'} "
                    f"attention; roles: {', '.join(r.name for r in inp.roles)}; "
                    f"{inp.workload.seq_length} tokens per sequence")
    return plan


def communicators(inp: PlanInput, stage: int = 0):
    """The NCCL communicators of a trainer process of pipeline ``stage`` (``terms.nccl_communicators``) for this
    plan's layout, roles and rollout (colocated: the weight sync's broadcast groups; disaggregated: a stage
    leader's weight-update group with the engines)."""
    lay, eng = inp.layout, inp.engine
    trainable = [r for r in inp.roles if r.trainable]
    world = lay.tp * lay.cp * lay.pp * lay.dp
    sync_groups, engine_group = (), 0
    if eng is not None and eng.colocated:
        sync_groups = sync_broadcast_groups(world, lay.pp, lay.tp, eng.num_engines, eng.tp)
    elif eng is not None and not eng.colocated:
        engine_group = 1 + eng.num_engines * eng.tp
    return nccl_communicators(tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=lay.ep, vpp=lay.vpp, stage=stage,
                              tied=inp.model.tie_word_embeddings,
                              distributed_optimizer=any(r.distributed_optimizer for r in trainable),
                              other_optimizer=any(not r.distributed_optimizer for r in trainable),
                              sync_groups=sync_groups, engine_group=engine_group)


def _context(inp: PlanInput, stage: int, later: bool) -> list[Item]:
    """The trainer process's CUDA context and NCCL communicators on its GPU: those that exist at the engine's
    start, or (``later``) every one (from the first step on)."""
    if not inp.cuda:
        return []
    comms = [c for c in communicators(inp, stage) if later or c.at_start]
    nbytes = sum(inp.nccl_pair_comm_bytes if c.ranks == 2 else inp.nccl_comm_bytes for c in comms)
    return [Item("trainer CUDA context", inp.cuda_context_bytes, False),
            Item(f"NCCL communicators ({len(comms)})", nbytes, False)]


def _trainer_phases(inp: PlanInput, plan: MemoryPlan, stage_plans, ctx, engine_released) -> None:
    """log-probs / values / per-role fwd+bwd and optimizer step, worst stage each."""
    roles = {r.name: r for r in inp.roles}

    def worst(name: str, build, knob: str) -> None:
        if inp.engine is not None and inp.engine.colocated and not inp.engine.memory_saver:
            knob += "; or release the engine during training (SGLang enable_memory_saver)"
        cands = [Phase(name, ctx(stage) + at_start + adam + engine_released + build(stage, statics), knob, stage)
                 for stage, statics, at_start, adam, _ in stage_plans]
        plan.phases.append(max(cands, key=lambda p: p.peak))

    lp_knob = "lower actor.log_prob_micro_batch_size_per_gpu (the logits of a micro batch dominate), or raise tp"
    teacher_knob = ("lower distill.teacher.log_prob_micro_batch_size_per_gpu, raise "
                    "distill.teacher.tensor_model_parallel_size, or set distill.teacher.param_offload=true")
    for name in ("actor", "reference", "teacher"):
        if name in roles:
            worst(f"{name} log-probs", lambda st, s, r=roles[name]: [
                Item(f"forward peak (micro batch {_own(inp, r).workload.log_prob_micro_batch})",
                     _forward_peak(inp, r, st)), *_loaded(r, s[r.name], ("params",))],
                  teacher_knob if name == "teacher" else lp_knob)
    if "critic" in roles:
        worst("critic values", lambda st, s: [Item(f"forward peak (micro batch {inp.workload.log_prob_micro_batch})",
                                                   _forward_peak(inp, roles["critic"], st)),
                                              *_loaded(roles["critic"], s["critic"], ("params",))], lp_knob)
    for role in inp.roles:
        if not role.trainable:
            continue

        def train(st, s, r=role):
            stored, peak = _train_peak(inp, r, st)
            return [Item(f"stored activations (micro batch {r.micro_batch})", stored),
                    Item("logits / layer backward peak", peak), *_loaded(r, s[r.name])]

        worst(f"{role.name} fwd/bwd", train,
              f"lower {role.name}.ppo_micro_batch_size_per_gpu, set parallel.recompute=full, or raise tp "
              f"(with parallel.sequence_parallel=true)")

        def step(st, s, r=role):
            n = s[r.name]["_optimizer_params"]
            loaded = _loaded(r, s[r.name])
            if inp.fused_adam:
                return loaded
            # CUDA: foreach Adam's sqrt(exp_avg_sq) for the whole group + the gradient clip's scaled copy of the
            # largest tensor (megatron's local multi_tensor_scale); CPU: two temporaries of the largest tensor
            big = s[r.name]["_max_param"]
            temp = 4 * n + 4 * big if inp.cuda else 8 * big
            return [Item("Adam step temporaries (torch Adam, no fused kernel)", temp), *loaded]

        worst(f"{role.name} optimizer step", step,
              "install Transformer Engine (FusedAdam) or use the distributed optimizer")


def save_gather_bytes(inp: PlanInput, role: Role, static: dict) -> float:
    """GPU bytes megatron's distributed optimizer receives while a checkpoint save gathers `role`'s state on one rank.

    megatron-core 0.16.1 ``DistributedOptimizer.sharded_state_dict`` in the ``fully_reshardable`` format (our
    ``parallel.dist_checkpoint.OPTIMIZER_METADATA``; ``distrib_optim_fully_reshardable_mem_efficient`` off) calls
    ``get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)``: for each grad buffer (dense,
    expert) and bucket, and each of ``param``, ``exp_avg``, ``exp_avg_sq`` in turn, every DP rank all-gathers the
    fp32 shards over DP onto its GPU (``dp`` tensors of the bucket's local numel: the whole bucket) after copying its
    own shard there (``send_tensor.cuda()``), then moves them to the host before the next key.  With
    ``overlap_grad_reduce=False`` (parallel.optim.wrap_ddp) a buffer is one bucket, so the peak is the larger buffer's
    ``4 x N x (1 + 1/dp)`` bytes, N its elements on this rank (the rank's TP x PP shard of those parameters; expert
    buffers over the expert data-parallel size).  0 without the distributed optimizer or at DP 1 (nothing gathered)."""
    if not (role.trainable and role.distributed_optimizer and inp.layout.dp > 1):
        return 0.0
    dense = 4.0 * static["_dense"] * (1 + 1 / inp.layout.dp)
    expert = 4.0 * static["_expert"] * (1 + 1 / static["_edp"]) if static["_expert"] and static["_edp"] > 1 else 0.0
    return max(dense, expert)


def _save_phase(inp: PlanInput, plan: MemoryPlan, stage_plans, ctx, engine_hold, engine_released) -> None:
    """"checkpoint save", worst stage: every role's state resident (``BaseTrainer.roles_resident`` loads the
    offloaded parts back), Adam's moments, and the largest distributed-optimizer gather of one role
    (:func:`save_gather_bytes`; the roles save one after another).  Colocated engines are released around the save
    (``PPOTrainer.save_context`` -> ``RolloutWorker.released``): only their context and runtime pool stay, unless
    ``release_for_save`` is off (then weights + KV cache stay too)."""
    eng = inp.engine
    engine = engine_released if eng is not None and eng.colocated and eng.release_for_save else engine_hold
    knob = ("raise tp or pp (the gather is the rank's TP x PP shard of a role in fp32, over DP), or offload "
            "the optimizer (<role>.offload.optimizer)")
    if eng is not None and eng.colocated and not (eng.release_for_save and eng.memory_saver):
        knob += "; or release the engines around the save (rollout.enable_memory_saver=true)"
    cands = []
    for stage, statics, at_start, adam, _ in stage_plans:
        gathers = [(save_gather_bytes(inp, r, statics[r.name]), r.name) for r in inp.roles]
        big, who = max(gathers, default=(0.0, ""))
        loaded = [i for r in inp.roles if r.offload for i in _loaded(r, statics[r.name])]
        items = ctx(stage) + at_start + adam + engine + loaded
        if big:
            items.append(Item(f"{who} distributed-optimizer state gathered over DP (fp32, one state at a time)", big))
        cands.append(Phase("checkpoint save", items, knob, stage))
    plan.phases.append(max(cands, key=lambda p: p.peak))


def format_plan(plan: MemoryPlan, verbose: bool = False) -> str:
    """The plan as a text table: one row per phase (peak, headroom, status, largest items); the knob for
    each phase that does not fit; the engine's share and KV cache; `verbose` lists every item."""
    g = GiB
    lines = [f"Memory plan: {plan.summary}",
             f"{'phase':<26}{'peak GiB':>9}{'free GiB':>10}  {'status':<6} largest items (GiB)"]
    for p in plan.phases:
        items = sorted(p.items, key=lambda i: -i.bytes)
        top = ", ".join(f"{i.name} {i.bytes / g:.1f}" for i in (items if verbose else items[:3]))
        status = "ok" if p.peak <= plan.gpu_bytes else "OOM"
        lines.append(f"{p.name:<26}{p.peak / g:>9.1f}{(plan.gpu_bytes - p.peak) / g:>10.1f}  {status:<6} {top}")
    if plan.engine_static is not None:
        lines.append(f"engine: free at start {plan.engine_free_at_start / g:.1f} GiB, static share "
                     f"{plan.engine_static / g:.1f} GiB, KV cache {plan.kv_cache_bytes / g:.1f} GiB "
                     f"({plan.kv_cache_tokens:,.0f} tokens)"
                     + (f"; largest mem_fraction_static that fits: {plan.max_mem_fraction_static:.2f}"
                        if plan.max_mem_fraction_static is not None else ""))
    knobs = plan.knobs()
    lines.append("fits" if not knobs else "DOES NOT FIT:")
    lines += [f"  - {k}" for k in knobs]
    return "\n".join(lines)
