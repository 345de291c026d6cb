"""Run batches of token sequences through megatron GPTModel chunks with megatron-core's pipeline
schedule, producing per-token log-probs / entropy (actor, reference) or values (critic).

Layout.  Rollout batches are left-padded prompts followed by right-padded responses.  Before the
model, each row is rotated left so its first real token sits at position 0 ("left-aligned");
every real token then only attends to real tokens under the plain causal mask, which both
megatron's local attention and Transformer Engine's fused causal kernels apply without an explicit
mask.  Outputs are rotated back, so callers see the original layout.  Position ids are the
caller's (first real token 0), rotated with the tokens.

Token outputs are aligned with `input_ids`: `log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, <t])`
(position 0 and padding hold 0). Callers slice the response part with `[:, -response_length:]`.

Context parallelism (parallel.context_parallel) feeds each rank its 1/cp of every row (megatron's
load-balanced 2*cp-chunk split) and gathers per-token outputs back to the full row, so everything
after the model sees [B, S] as without CP; S is padded to a multiple of 2*cp the same way.

Sequence parallelism needs S to be a multiple of tp: rows are padded on the RIGHT of the
left-aligned layout (after every real token), so causal attention leaves the real tokens' outputs
unchanged, and the padding is cut off again before anything is returned: callers get [B, S] for
the S they passed, and `[:, -R:]` slices the same response tokens as without padding.

Device rule (one for CPU and GPU): compute happens on the device of the model's parameters (the
micro batches are moved there); everything returned (token outputs and loss_fn metrics) is on the
device of the batch's `input_ids`.  Each role (rlhf.workers.worker.MegatronWorker) moves a batch to
`parallel.distributed.compute_device()` once when it comes in (`batch_to_device`), so masks and outputs
then share that device and no copy happens here.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from parallel import devices
from parallel.context_parallel import gather_from_context_parallel, split_for_context_parallel
from parallel.context_parallel import seq_length_multiple as cp_seq_length_multiple

_PADDED_KEYS = ("input_ids", "attention_mask", "position_ids")


def left_align(x: torch.Tensor, shifts: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate each row of x [b, s, ...] left by shifts[b] (right when inverse)."""
    b, s = x.shape[:2]
    idx = torch.arange(s, device=x.device).unsqueeze(0)
    idx = (idx - shifts.unsqueeze(1)) % s if inverse else (idx + shifts.unsqueeze(1)) % s
    if x.dim() > 2:
        idx = idx.view(b, s, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx)


def batch_to_device(batch: dict, device) -> dict:
    """A copy of `batch` with every tensor value moved to `device` (other values as they are;
    parallel.devices.to_device)."""
    return devices.to_device(dict(batch), device)


def split_micro_batches(batch: dict, micro_batch_size: int) -> list[dict]:
    """Split a dict of [B, ...] tensors (other values are split if they are lists of length B)."""
    n = batch["input_ids"].shape[0]
    if micro_batch_size < 1 or n % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch size {n}")
    out = []
    for i in range(0, n, micro_batch_size):
        mb = {}
        for k, v in batch.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n:
                mb[k] = v[i:i + micro_batch_size]
            elif isinstance(v, list) and len(v) == n:
                mb[k] = v[i:i + micro_batch_size]
            else:
                mb[k] = v
        out.append(mb)
    return out


def _token_outputs(output: torch.Tensor, mb: dict, kind: str, vocab_size: int, temperature: float,
                   calculate_entropy: bool) -> dict:
    """Model output in left-aligned layout -> token outputs in the original layout."""
    from parallel.logprobs import log_probs_from_megatron_logits

    shifts = mb["_shifts"]
    mask = mb["attention_mask"].bool()
    # under context parallelism `output` holds this rank's tokens only: per-token results are computed
    # locally and gathered to the full sequence (identity for cp = 1)
    if kind == "logits":  # debugging/tests only: gathers the full vocabulary
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        full = gather_from_context_parallel(gather_from_tensor_model_parallel_region(output)[..., :vocab_size].float())
        return {"logits": left_align(full, shifts, inverse=True)}
    if kind == "values":
        values = left_align(gather_from_context_parallel(output.squeeze(-1).float()), shifts, inverse=True)
        return {"values": torch.where(mask, values, torch.zeros_like(values))}
    # logits at t predict token t+1: labels come from the full sequence, then take this rank's part
    labels = split_for_context_parallel({"labels": torch.roll(mb["_aligned_ids"], shifts=-1, dims=1)})["labels"]
    log_probs, entropy = log_probs_from_megatron_logits(output, labels, vocab_size, temperature, calculate_entropy)
    log_probs = gather_from_context_parallel(log_probs)
    entropy = None if entropy is None else gather_from_context_parallel(entropy)
    # prediction for token t+1 lives at t: move it to t+1, then undo the alignment
    log_probs = left_align(torch.roll(log_probs, 1, dims=1), shifts, inverse=True)
    first = torch.zeros_like(mask)
    first[torch.arange(mask.shape[0]), shifts] = True
    valid = mask & ~first
    out = {"log_probs": torch.where(valid, log_probs, torch.zeros_like(log_probs))}
    if entropy is not None:
        entropy = left_align(torch.roll(entropy, 1, dims=1), shifts, inverse=True)
        out["entropy"] = torch.where(valid, entropy, torch.zeros_like(entropy))
    return out


def forward_backward(model_chunks, batch: dict, *, kind: str = "log_probs", vocab_size: int | None = None,
                     micro_batch_size: int = 1, temperature: float = 1.0, calculate_entropy: bool = False,
                     loss_fn: Callable | None = None, forward_only: bool = True, seq_length_multiple: int = 1,
                     routing=None, record_routing: bool = False):
    """Run `batch` through the model with megatron-core's pipeline schedule.

    Args:
        model_chunks: list of GPTModel (or DDP-wrapped) chunks of this rank.
        batch: dict with `input_ids` [B, S] int64, `attention_mask` [B, S] (1 = real token; left-padded
            prompts, right-padded responses), `position_ids` [B, S]; any other [B, ...] tensors
            travel to `loss_fn` in the micro batch.
        kind: "log_probs" (actor/reference) or "values" (critic).
        loss_fn: `loss_fn(outputs: dict, micro_batch: dict) -> (loss scalar, metrics dict)`; required
            when forward_only is False. megatron divides the loss by the number of micro batches.
            It sees [b, S] outputs and inputs for the caller's S (any padding for sequence
            parallelism is already cut off), on the compute device.
        seq_length_multiple: pad S to a multiple of this; under sequence parallelism S is padded to
            a multiple of tp as well (automatically, read from the model's config).
        routing: a parallel.router_replay.RoutingReplay of these chunks (MoE routing replay): when the batch
            holds ``routed_experts`` [B, S, L, k] the routers replay them; with `record_routing` (forward_only
            without loss_fn) the result also holds ``routed_experts`` [B, S, L, k] int64, the experts the
            routers used (parallel.router_replay).
    Returns:
        forward_only without loss_fn: dict of [B, S] float32 tensors (`log_probs`, `entropy` or
        `values`) on EVERY rank (broadcast from the last pipeline stage).
        Otherwise: list of the per-micro-batch metrics dicts (last stage; empty elsewhere).
        Either way on the device of `batch["input_ids"]` (see the module's device rule).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if kind not in ("log_probs", "values", "logits"):
        raise ValueError(f"kind={kind!r}: use 'log_probs', 'values' or 'logits' (tests only)")
    if kind in ("log_probs", "logits") and vocab_size is None:
        raise ValueError("vocab_size (the unpadded vocabulary size) is required for log_probs")
    if not forward_only and loss_fn is None:
        raise ValueError("forward_only=False needs a loss_fn")
    from megatron.core.utils import get_model_config

    needed = cp_seq_length_multiple(ps.get_context_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                                    get_model_config(model_chunks[0]).sequence_parallel)
    seq_length_multiple = seq_length_multiple * needed // math.gcd(seq_length_multiple, needed)
    batch = dict(batch)
    input_ids = batch["input_ids"]
    out_device = input_ids.device
    B, S = input_ids.shape
    pad = (-S) % seq_length_multiple
    replay = routing is not None and batch.get("routed_experts") is not None
    if pad:
        for k in _PADDED_KEYS:
            batch[k] = torch.nn.functional.pad(batch[k], (0, pad), value=0)
        if replay:
            from parallel.router_replay import pad_routing

            batch["routed_experts"] = pad_routing(batch["routed_experts"], pad)
        S += pad
    mask = batch["attention_mask"].bool()
    if not bool(mask.any(1).all()):
        raise ValueError("every row needs at least one real token (attention_mask all zero in some row)")
    batch["_shifts"] = mask.int().argmax(1)  # leading pads per row
    batch["_aligned_ids"] = left_align(batch["input_ids"], batch["_shifts"])
    batch["_aligned_pos"] = left_align(batch["position_ids"], batch["_shifts"])
    device = next(iter(model_chunks[0].parameters())).device
    micro_batches = split_micro_batches(batch, micro_batch_size)
    collected: list[dict] = []

    def loss_func(mb, output):
        outs = _token_outputs(output, mb, kind, vocab_size, temperature, calculate_entropy)
        if loss_fn is None:
            collected.append({k: v.detach() for k, v in outs.items()})
            return torch.zeros((), device=output.device), {}
        # loss_fn sees the caller's layout: [b, S] outputs and inputs (the padding for sequence parallelism
        # cut off again), so `[:, -R:]` is the response
        outs = {k: v[:, :S - pad] for k, v in outs.items()}
        mb = {k: (v[:, :S - pad] if k in _PADDED_KEYS else v) for k, v in mb.items() if not k.startswith("_")}
        loss, metrics = loss_fn(outs, mb)
        return loss, {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in metrics.items()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        mb = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in mb.items()}
        if replay:
            routing.set_replay(model, left_align(mb["routed_experts"], mb["_shifts"]))
        local = split_for_context_parallel({"ids": mb["_aligned_ids"], "pos": mb["_aligned_pos"]})
        output = model(local["ids"], local["pos"], None)
        if replay:
            routing.after_forward(model)
        return output, partial(loss_func, mb)

    n_chunks = len(model_chunks)
    iterators = [iter(micro_batches) for _ in range(n_chunks)]
    record = routing is not None and record_routing and forward_only and loss_fn is None
    if routing is not None:
        routing.begin(replay=replay, record=record)
    try:
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if n_chunks > 1 else iterators[0],
            model=model_chunks, num_microbatches=len(micro_batches), seq_length=S,
            micro_batch_size=micro_batch_size, forward_only=forward_only)
    finally:
        if routing is not None:
            routing.end()
    if loss_fn is not None:
        return [{k: (v.to(out_device) if torch.is_tensor(v) else v) for k, v in m.items()} for m in metrics]
    # gather the token outputs from the last pipeline stage onto every rank
    names = {"values": ["values"], "logits": ["logits"]}.get(
        kind, ["log_probs", "entropy"] if calculate_entropy else ["log_probs"])
    result = {}
    for name in names:
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            t = torch.cat([c[name] for c in collected], 0).float()
        else:
            shape = (B, S, vocab_size) if kind == "logits" else (B, S)
            t = torch.empty(shape, dtype=torch.float32, device=device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            pp_group = ps.get_pipeline_model_parallel_group()
            t = devices.to_group_device(t, pp_group)
            dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
        result[name] = (t[:, : S - pad] if pad else t).to(out_device)
    if record:
        result["routed_experts"] = routing.recorded([mb["_shifts"] for mb in micro_batches], S - pad).to(out_device)
    return result
