"""Byte counts behind :mod:`rlhf.memory_plan.planner`: parameters per pipeline stage, optimizer state,
activations per micro batch, the log-prob/logit peak and the SGLang engine's KV cache.  Pure
functions on plain numbers (no torch import).

Activations follow the accounting method of Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198, Sec. 4.1, eqs. 1-2: sum the tensors
each layer keeps for its backward pass, divided by t for tensor-parallel tensors and, with sequence
parallelism, for the replicated ones too; full recompute keeps only each layer's input, selective
recompute drops the s x s attention terms).  Their 34 s b h + 5 a s^2 b assumes a GPT-3 block (GeLU
4h MLP, dropout, fp16 softmax); the terms below are recounted for our blocks (RMSNorm, GQA, RoPE,
SwiGLU, no dropout) in megatron-core 0.16.1 and torch 2.14:

* local spec (no Transformer Engine): torch's composite RMSNorm (CPU) keeps two fp32 copies of its
  input (8 bytes/element; torch's fused CUDA kernel keeps the input and the fp32 1/rms), GQA
  keys/values are expanded to all heads before the unfused attention,
  whose fp32 softmax output and bf16 probabilities are kept (6 bytes per score; 4 in fp32), and the
  SwiGLU keeps fc1's output, silu's output and the product (5 f per token; 3 f with megatron's
  bias_activation_fusion).  These were checked
  tensor by tensor with `torch.autograd.graph.saved_tensors_hooks` (5.23 MB counted vs 5.23 MB
  saved for h=256, f=704, 8 heads / 2 groups, s=128, b=2, bf16).
* Transformer Engine spec: fused norm+linear keeps the norm input and output, flash attention keeps
  q, k, v, its output and the fp32 log-sum-exp (no s x s term), the fused MLP keeps fc1's output
  and the activation (3 f per token).

Parameter and optimizer bytes per parameter follow the Megatron-LM distributed-optimizer table
(docs "Distributed Optimizer": bf16 params + fp32 grads = 6 bytes, fp32 main params + Adam moments
= 12 bytes, divided by the data-parallel size with the distributed optimizer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

GiB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """The HF config facts the planner needs (element counts)."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    # DeepSeek-V3: multi-latent attention sizes (kv_lora_rank > 0 marks MLA), leading dense layers,
    # the shared experts' fused intermediate size
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    dense_layers: int = 0
    shared_ffn_hidden_size: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @classmethod
    def from_hf_config(cls, hf: Any) -> "ModelShape":
        """From a config.json dict or a transformers config (its `to_dict()`).  Raises KeyError naming a
        missing key."""
        d: Mapping = hf.to_dict() if hasattr(hf, "to_dict") else hf
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if k not in d:
                raise KeyError(f"HF config lacks {k!r}; pass the model's config.json")
        heads = d["num_attention_heads"]
        arch = (d.get("architectures") or [""])[0]
        experts = d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts") or 0
        mla = {}
        if d.get("kv_lora_rank"):  # DeepSeek-V3 / Moonlight
            mla = dict(q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"],
                       qk_rope_head_dim=d["qk_rope_head_dim"], qk_nope_head_dim=d["qk_nope_head_dim"],
                       v_head_dim=d["v_head_dim"], dense_layers=d.get("first_k_dense_replace") or 0,
                       shared_ffn_hidden_size=(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"])
        return cls(**mla,
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], ffn_hidden_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bool(d.get("attention_bias", False)) or arch.startswith("Qwen2"),
            qk_norm=arch.startswith("Qwen3"), num_experts=experts, moe_topk=d.get("num_experts_per_tok") or 0,
            moe_ffn_hidden_size=(d.get("moe_intermediate_size") or d["intermediate_size"]) if experts else 0)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocabulary padding: up to a multiple of divisible_by * tp."""
    m = divisible_by * tp
    return -(-vocab // m) * m


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Transformer layers on each pipeline stage (uneven first/last stages as megatron-core splits them)."""
    if pp == 1:
        return [num_layers]
    inner = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    each = rest // inner if inner else 0
    out = [each] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def _mla_params(m: ModelShape, tp: int) -> float:
    """One MLA layer's attention parameters on one rank: column-parallel q/kv down and up projections
    (megatron splits all four over TP), the replicated latent norms, the row-parallel output."""
    a, h, qk = m.num_attention_heads, m.hidden_size, m.qk_nope_head_dim + m.qk_rope_head_dim
    q = (h * m.q_lora_rank + m.q_lora_rank * a * qk) / tp + m.q_lora_rank if m.q_lora_rank else h * a * qk / tp
    kv = (h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)) / tp
    return q + kv + m.kv_lora_rank + a * m.v_head_dim * h / tp


def layer_params(m: ModelShape, tp: int, ep: int = 1, etp: int | None = None,
                 moe: bool = True) -> tuple[float, float]:
    """(dense, expert) parameter elements of one transformer layer on one rank.  `moe=False`: one of
    a MoE model's leading dense-MLP layers (DeepSeek-V3's first_k_dense_replace)."""
    a, g, d, h = m.num_attention_heads, m.num_kv_heads, m.head_dim, m.hidden_size
    qkv_out = (a + 2 * g) * d
    attn = (h * qkv_out + (qkv_out if m.qkv_bias else 0) + a * d * h) / tp + (2 * d if m.qk_norm else 0)
    if m.mla:
        attn = _mla_params(m, tp)
    dense = attn + 2 * h  # + input and pre-MLP RMSNorm weights (replicated)
    if m.num_experts and moe:
        etp = tp if etp is None else etp
        router = m.num_experts * h + (m.num_experts if m.mla else 0)  # + DeepSeek's correction bias
        return (dense + router + 3 * h * m.shared_ffn_hidden_size / tp,
                (m.num_experts / ep) * 3 * h * m.moe_ffn_hidden_size / etp)
    return dense + 3 * h * m.ffn_hidden_size / tp, 0.0


def stage_params(m: ModelShape, tp: int, layers: int, first: bool, last: bool, *, value_head: bool = False,
                 pp: int = 1, ep: int = 1, etp: int | None = None, divisible_by: int = 128,
                 dense_mlp_layers: int = 0) -> tuple[float, float]:
    """(dense, expert) parameter elements held by one rank of a pipeline stage.

    The first stage holds the embedding; the last the final norm and the LM head (a replica of the
    embedding when tied and pp > 1, none when tied on a single stage) or, for the critic, a scalar head.
    `dense_mlp_layers`: how many of the stage's layers are a MoE model's leading dense-MLP layers.
    """
    dense, expert = layer_params(m, tp, ep, etp)
    plain, _ = layer_params(m, tp, ep, etp, moe=False)
    vocab = padded_vocab(m.vocab_size, divisible_by, tp)
    total = (layers - dense_mlp_layers) * dense + dense_mlp_layers * plain
    expert_layers = layers - dense_mlp_layers
    if first:
        total += vocab * m.hidden_size / tp
    if last:
        total += m.hidden_size  # final norm
        if value_head:
            total += m.hidden_size
        elif not m.tie_word_embeddings or pp > 1:
            total += vocab * m.hidden_size / tp
    return total, expert_layers * expert


def model_params(m: ModelShape) -> float:
    """All parameter elements of the HF model (for the rollout engine's weights)."""
    dense, expert = layer_params(m, 1)
    plain, _ = layer_params(m, 1, moe=False)
    head = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    k = m.dense_layers if m.num_experts else 0
    return (m.num_layers - k) * (dense + expert) + k * plain + m.vocab_size * m.hidden_size + head + m.hidden_size


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of one transformer layer for one micro batch on one rank.

    stored: kept from the layer's forward until its backward (per micro batch in flight).
    backward_transient: extra bytes while the layer's backward runs (gradient buffers).
    forward_transient: the largest live set of a forward without autograd (log-probs, values).
    """

    stored: float
    backward_transient: float
    forward_transient: float
    full_layer: float  # what a fully recomputed layer re-creates (= stored without recompute)


def layer_activations(m: ModelShape, seq: int, micro_batch: int, tp: int, *, sequence_parallel: bool,
                      act_bytes: int, flash_attention: bool, recompute: str | None,
                      fused_norm: bool = False, fused_swiglu: bool = False) -> ActivationBytes:
    """Per-layer activation bytes (see the module docstring for the counting).

    seq: tokens per sequence (after padding to a multiple of tp under sequence parallelism);
    act_bytes: 2 (bf16) or 4 (fp32); flash_attention: Transformer Engine spec (else the local spec);
    recompute: None, "selective" (attention core) or "full" (uniform, one layer per checkpoint);
    fused_norm: the local spec's torch RMSNorm runs torch's fused kernel (CUDA), which keeps its input
    and the fp32 1/rms instead of the composite's two fp32 copies (CPU); fused_swiglu: megatron's
    bias_activation_fusion keeps only fc1's output for the SwiGLU (3 f per token instead of 5 f).
    """
    x, e, h = seq * micro_batch, act_bytes, m.hidden_size
    t_sp = tp if sequence_parallel else 1
    heads, groups, d = m.num_attention_heads / tp, max(m.num_kv_heads / tp, 1), m.head_dim
    if m.mla:  # counted as MHA over q/k heads of qk_nope + qk_rope dims (v heads are no wider; small latents left out)
        groups, d = heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    f = (m.moe_ffn_hidden_size * max(m.moe_topk, 1)) if m.num_experts else m.ffn_hidden_size
    s2 = micro_batch * heads * seq * seq
    if flash_attention:
        norms = 4 * e * x * h / t_sp  # fused norm+linear: norm input and output, twice
        attn = e * x * d * (2 * heads + 2 * groups) + 4 * micro_batch * heads * seq  # q, k, v, out; fp32 LSE
        mlp = 3 * e * x * f / tp
        scores = 0.0
        attn_selective = attn
    else:
        norm = (e * x * h + 4 * x) if fused_norm else 8 * x * h  # input + 1/rms, or two fp32 copies (composite)
        norms = 2 * norm / t_sp + 2 * e * x * h / t_sp  # the two norms + the QKV / fc1 inputs
        expanded = groups < heads
        attn = e * x * d * (4 * heads if expanded else 6 * heads)  # q, k and v (expanded or the fused qkv), context
        attn_selective = e * x * d * (3 * heads + 3 * groups)  # checkpoint inputs q, k, the qkv output; context
        scores = s2 * (4 + (2 if e == 2 else 0)) + seq * seq  # fp32 softmax out (+ bf16 probs) + the causal mask
        mlp = (3 if fused_swiglu else 5) * e * x * f / tp
    full = norms + attn + scores + mlp
    grad_mlp = 2 * e * x * f / tp
    if flash_attention:
        bwd = grad_mlp + e * x * h / t_sp
        fwd = 4 * e * x * f / tp + 2 * e * x * h / t_sp
    else:
        bwd = max(4 * s2, grad_mlp) + e * x * h / t_sp
        fwd = max((12 if e == 2 else 8) * s2, 4 * e * x * f / tp) + 2 * e * x * h / t_sp
    if recompute == "full":
        stored = e * x * h / t_sp  # the checkpointed layer input
    elif recompute == "selective":
        stored = norms + attn_selective + mlp
    elif recompute is None:
        stored = full
    else:
        raise ValueError(f"recompute={recompute!r}: use None, 'selective' or 'full'")
    return ActivationBytes(stored=stored, backward_transient=bwd, forward_transient=fwd, full_layer=full)


def logits_bytes(m: ModelShape, tokens: int, tp: int, *, act_bytes: int, entropy: bool, temperature: float = 1.0,
                 divisible_by: int = 128, no_grad_seq: int | None = None) -> float:
    """Peak of the LM head output and `parallel.logprobs.vocab_parallel_log_probs` for `tokens` tokens.

    Per element of the [tokens, V_pad / tp] vocab-parallel logits: the logits (act_bytes), their fp32
    copy (bf16 only), the max-shifted logits and their exp (4 + 4), the padded-vocab mask fill (4, when
    V_pad > V), the temperature division of fp32 logits (4), and with entropy the zero-filled shifted
    logits and their product with exp (4 + 4).  With autograd, on every element.  Without (`no_grad_seq`: the
    sequence length, given for a no-grad forward), everything but the logits on one slice of whole sequences of at
    most `parallel.logprobs.NO_GRAD_CHUNK_ELEMENTS` logits (one sequence when a sequence alone is more).
    """
    from parallel.logprobs import NO_GRAD_CHUNK_ELEMENTS

    vocab = padded_vocab(m.vocab_size, divisible_by, tp)
    per = act_bytes + (4 if act_bytes != 4 else 0) + 8
    per += 4 if vocab != m.vocab_size else 0
    per += 4 if (temperature != 1.0 and act_bytes == 4) else 0
    per += 8 if entropy else 0
    elements = tokens * vocab / tp
    if no_grad_seq is None:
        return elements * per
    row = no_grad_seq * vocab / tp
    piece = min(elements, max(row, NO_GRAD_CHUNK_ELEMENTS // row * row))
    return elements * act_bytes + piece * (per - act_bytes)


def in_flight_micro_batches(pp: int, stage: int, num_micro: int, vpp: int | None = None) -> float:
    """Micro batches whose activations a stage holds at once under megatron's 1F1B schedule, in units
    of the stage's full layer count (Narayanan et al. 2021, Sec. 2.2: stage k keeps pp - k micro
    batches; interleaved: (pp - k - 1) * 2 + (vpp - 1) * pp + 1 chunks of 1/vpp of the layers)."""
    if pp == 1:
        return 1.0
    if not vpp:
        return float(min(num_micro, pp - stage))
    chunks = (pp - stage - 1) * 2 + (vpp - 1) * pp + 1
    return min(num_micro * vpp, chunks) / vpp


def kv_bytes_per_token(m: ModelShape, engine_tp: int, kv_bytes: int = 2) -> float:
    """SGLang MHA/GQA KV cache: K and V for every layer, the rank's KV heads (replicated when tp > heads).
    MLA (DeepSeek-V3): the latent and the shared rope key, kv_lora_rank + qk_rope_head_dim per token and
    layer, the same on every TP rank (SGLang's MLATokenToKVPool)."""
    if m.mla:
        return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * kv_bytes
    return 2 * m.num_layers * max(1, math.ceil(m.num_kv_heads / engine_tp)) * m.head_dim * kv_bytes


MiB = 1 << 20
#: GPU memory of one NCCL communicator on each of its members: 544 MB for a group of 2 ranks, 688 MB for more,
#: measured per process group on 4 A100 with NVLink, intra-node (NVIDIA/nccl#964); more communicators, more
#: memory, linear in the channels NCCL opens (NVIDIA/nccl#864, #986).  NVLS on NVSwitch systems and inter-node
#: transports take more; a one-rank group is counted 0 (recent NCCL may allocate more there: NVIDIA/nccl#2363).
NCCL_PAIR_COMM_BYTES = 544 * MiB
NCCL_COMM_BYTES = 688 * MiB


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator of a trainer process: its group's purpose, its size (ranks), and whether it exists
    when a colocated engine measures the free memory at its start (torch creates a group's communicator at the
    group's first collective: ``init_process_group`` gets no ``device_id`` in parallel.distributed)."""

    name: str
    ranks: int
    at_start: bool = False


def pipeline_peers(pp: int, stage: int, vpp: int | None = None) -> int:
    """Neighbours a pipeline stage sends to / receives from: the previous and the next stage, a ring with
    interleaving (the last stage feeds the first stage's next chunk)."""
    if pp == 1:
        return 0
    if vpp:
        return 1 if pp == 2 else 2
    return int(stage > 0) + int(stage < pp - 1)


def nccl_communicators(*, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1, vpp: int | None = None,
                       stage: int = 0, tied: bool = False, distributed_optimizer: bool = True,
                       other_optimizer: bool = False, sync_groups: tuple = (),
                       engine_group: int = 0) -> list[Communicator]:
    """The NCCL communicators one trainer process of pipeline ``stage`` creates (groups of one rank left out).

    world = tp * cp * pp * dp.  From megatron-core 0.16.1 (``parallel_state.initialize_model_parallel`` makes a
    separate process group, hence communicator, per purpose, the data-parallel group with and without context
    parallelism included) and how the trainer uses them: the world (the rank-to-node exchange at
    ``init_distributed``: before the engines start), tensor parallel, data parallel with CP (megatron DDP's
    gradient reduction, the distributed optimizer's gathers), data parallel (parallel.forward's rollout gathers
    and padding metric: ``get_data_parallel_group()``), context parallel, pipeline parallel (the PP broadcast)
    plus one two-rank communicator per pipeline neighbour (``batch_p2p_comm=False``: torch's ProcessGroupNCCL
    gives an unbatched send/recv a communicator per rank pair), the tied-embedding gradients' group (first and
    last stage), the gradient-norm group (the distributed optimizer's instance group = every rank; else the
    model-parallel group tp x pp; both when the roles differ: ``other_optimizer``), expert parallelism's groups,
    the weight sync's broadcast groups (``sync_groups``: their sizes, from_tensor.broadcast_group) and a
    disaggregated stage leader's weight-update group with the engines (``engine_group``: its size).
    """
    world = tp * cp * pp * dp
    out: list[Communicator] = []

    def add(name: str, ranks: int, at_start: bool = False) -> None:
        if ranks > 1:
            out.append(Communicator(name, ranks, at_start))

    add("world", world, True)
    add("tensor parallel", tp)
    add("data parallel x context parallel", dp * cp)
    add("data parallel", dp)
    add("context parallel", cp)
    add("pipeline parallel", pp)
    for _ in range(pipeline_peers(pp, stage, vpp)):
        add("pipeline send/recv pair", 2)
    if tied and pp > 1 and stage in (0, pp - 1):
        add("tied embedding", 2)
    if distributed_optimizer:
        add("gradient norm (distributed optimizer)", world)
    if other_optimizer or not distributed_optimizer:
        add("gradient norm (model parallel)", tp * pp)
    if ep > 1:
        add("expert parallel", ep)
        add("expert data parallel", dp // ep)
    for size in sync_groups:
        add("weight sync broadcast", size)
    add("weight update with the engines", engine_group)
    return out


def sync_broadcast_groups(world: int, pp: int, tp: int, num_engines: int, engine_tp: int) -> tuple[int, ...]:
    """Sizes of the process groups the colocated weight sync's engine-local handles create (every one has rank 0,
    the controller, as a member): per pipeline stage the leader (``s * world / pp``) and the holders (trainer rank
    ``e * engine_tp + r`` for engine rank (e, r), the stage leader past the trainer's ranks), one group per distinct
    member set that is neither every rank nor a tensor-parallel group (megatron's default order: ranks
    ``k * tp .. k * tp + tp - 1``), which the sync reuses (rlhf.rollout.placement.holder_ranks and
    rlhf.weight_bridge.from_tensor.broadcast_group: this mirrors them on plain numbers)."""
    sets = set()
    for s in range(pp):
        leader = s * (world // pp)
        held = {e * engine_tp + r if e * engine_tp + r < world else leader
                for e in range(num_engines) for r in range(engine_tp)}
        if held - {leader}:
            members = tuple(sorted(held | {leader}))
            tp_group = len(members) == tp and members[0] % tp == 0 and members == tuple(range(members[0],
                                                                                               members[0] + tp))
            if members != tuple(range(world)) and not tp_group:
                sets.add(members)
    return tuple(len(m) for m in sorted(sets))


def oversize_sync_bytes(*, vocab: int, hidden: int, tp: int, divisible_by: int, params_bytes: int, weight_bytes: int,
                        bucket_bytes: float) -> tuple[float, float]:
    """``(on the stage leader's GPU, on a holder's GPU)``: the bytes the weight sync's largest tensor (an
    embedding or LM head, vocab x hidden) takes beyond the plan's "gathered + packed" item (2 x ``bucket_bytes``:
    the bucket pool, two buffers of ``bucket_bytes / 2``, and ``bucket_bytes`` for the leader's receive buffer), or
    (0, 0) when it fits one pool buffer.

    A larger tensor gets a bucket of its own outside the pool (rlhf.weight_bridge.bucketing.fill_buckets,
    BufferPool.acquire), taken from the stream before its buffer exists, so on the leader its TP peers' rows (tp > 1;
    the unpadded vocabulary past rank 0's ``padded / tp`` rows, in the trainer's dtype) are received into the receive
    buffer (BufferPool.scratch, grown to them and kept through the sync), then written with the leader's own rows
    straight into the bucket (``vocab x hidden`` in the engine dtype, cast there: no concatenated or cast copy,
    parallel.convert.shard_regions.HFTensorParts), which stays mapped by the engines while the next parameter is
    received and written into the pool.  The receive buffer is max(those rows, the ``bucket_bytes`` the item allows
    for the other parameters' receives); with tp = 1 there is none, and the allowance holds part of the bucket.  On
    a holder: one copy of the bucket.  SGLang's loaders need the whole HF tensor
    (``VocabParallelEmbedding.weight_loader`` asserts the full vocabulary and narrows it itself), so it cannot be
    sent in slices through the pool."""
    sent = vocab * hidden * weight_bytes
    if sent <= bucket_bytes / 2:
        return 0.0, 0.0
    gathered = max(vocab - padded_vocab(vocab, divisible_by, tp) // tp, 0) * hidden * params_bytes if tp > 1 else 0
    receive = max(gathered, bucket_bytes) if tp > 1 else 0.0
    return float(max(receive + sent - bucket_bytes, 0.0)), float(sent)
