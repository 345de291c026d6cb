"""What the actor and the critic share: a megatron model on every trainer rank, a no-grad forward
over the data-parallel split, and the ONE mini-batch update loop.

Every method is collective over the whole trainer job: each data-parallel rank works on its slice
of the batch, and results are all-gathered so every rank holds full-batch tensors.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlhf.mcore.forward import forward_backward
from rlhf.mcore.optim import optimizer_step, zero_grads

from .batch import MODEL_KEYS, dp_info, dp_slice, micro_batch_size, mini_batch_indices, pipeline_micro_batch_multiple

__all__ = ["MegatronWorker", "gather_metrics", "step_metrics", "GLOBAL_INFO_KEY"]

#: key of the micro batch dict that carries the whole mini batch's counts to the loss function:
#: ``{"dp_size", "num_micro_batches", ...}`` plus what the loss's ``global_info`` returned (see
#: :meth:`MegatronWorker.train_mini_batches`)
GLOBAL_INFO_KEY = "global_info"


def gather_metrics(per_micro: list[dict]) -> dict:
    """Mean of each metric over micro batches and over every rank that has it (the last PP stage)."""
    local = defaultdict(list)
    for m in per_micro:
        for k, v in m.items():
            local[k].append(float(v))
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, dict(local))
    merged = defaultdict(list)
    for o in objs:
        for k, v in (o or {}).items():
            merged[k].extend(v)
    return {k: float(np.mean(v)) for k, v in merged.items()}


def step_metrics(role: str, steps: list) -> dict:
    """Metrics of a role's optimizer steps (rlhf.mcore.optim.StepResult): <role>/grad_norm (mean pre-clip
    norm), <role>/num_skipped_steps (non-finite gradient norm: the update was skipped),
    <role>/num_breaker_events (the gradient circuit breaker restarted the LR warm-up)."""
    return {f"{role}/grad_norm": float(np.mean([s.grad_norm for s in steps])),
            f"{role}/num_skipped_steps": float(sum(s.skipped for s in steps)),
            f"{role}/num_breaker_events": float(sum(s.breaker is not None for s in steps))}


class MegatronWorker:
    """A megatron model (`bundle`: rlhf.mcore.models.ModelBundle) and, when it trains, its
    `state` (rlhf.mcore.optim.TrainState: DDP chunks, optimizer, LR scheduler)."""

    def __init__(self, bundle, state=None, *, forward_micro_batch_size: int):
        self.bundle, self.state = bundle, state
        self.forward_micro_batch_size = forward_micro_batch_size

    @property
    def chunks(self) -> list:
        """The model's GPTModel chunks (one per virtual pipeline stage on this rank)."""
        return self.bundle.chunks

    @property
    def vocab_size(self) -> int:
        """Unpadded vocabulary size of the model."""
        return self.bundle.spec.vocab_size

    def forward(self, batch: dict, **forward_kwargs) -> dict:
        """No-grad forward of this rank's data-parallel slice of `batch` (MODEL_KEYS) in micro batches
        of at most `forward_micro_batch_size`; returns the local [N / dp, P + R] outputs of
        rlhf.mcore.forward.forward_backward (`log_probs` / `entropy` / `values`).  Under virtual pipeline
        stages the number of micro batches is a multiple of the pipeline size (megatron's interleaved
        schedule): a slice that does not split so is padded with copies of its last row, whose outputs
        are dropped."""
        rank, size, _ = dp_info()
        local = {k: dp_slice(batch[k], rank, size) for k in MODEL_KEYS}
        n, multiple = local["input_ids"].shape[0], pipeline_micro_batch_multiple()
        pad = (-n) % multiple
        if pad:
            local = {k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])], 0) for k, v in local.items()}
        with torch.no_grad():
            out = forward_backward(self.chunks, local, micro_batch_size=micro_batch_size(
                n + pad, self.forward_micro_batch_size, multiple_of=multiple), **forward_kwargs)
        return {k: v[:n] for k, v in out.items()} if pad else out

    def train_mini_batches(self, batch: dict, keys: Sequence[str], loss_fn: Callable, *, mini_batch_size: int,
                           micro_batch_size_per_gpu: int, epochs: int, step: int, seed_offset: int = 0,
                           micro_group: int = 1, global_info: Callable | None = None,
                           **forward_kwargs) -> tuple[list[dict], list]:
        """The mini-batch update loop (verl's / PPO's): `epochs` passes over the batch, one optimizer
        step per mini batch of `mini_batch_size` prompts (x batch["n"] sequences), gradients
        accumulated over micro batches of at most `micro_batch_size_per_gpu` sequences (whole groups
        of `micro_group` rows; under virtual pipeline stages a multiple of the pipeline size of them).
        With several epochs each pass visits the rows in a permutation seeded by
        `step * 1000 + seed_offset + epoch`; with one, in order.  `loss_fn(outputs, micro_batch) ->
        (loss, metrics)` sees the micro batch's `keys` and, under GLOBAL_INFO_KEY, the counts that make
        its loss independent of the split (rlhf.algorithms.agg_loss, "the x n_micro rule"):
        ``dp_size``, ``num_micro_batches`` (of this rank in this mini batch; megatron divides each micro
        batch loss by it, so a loss function multiplies by it) and ``global_info(full_mini_batch,
        dp_size)`` computed on the WHOLE mini batch (every data-parallel rank's rows, `keys` only)
        before it is split.

        Returns (per-micro-batch metrics of this rank, rlhf.mcore.optim.StepResult of every optimizer step).
        """
        rank, size, _ = dp_info()
        n_mini = max(1, batch["input_ids"].shape[0] // (mini_batch_size * batch["n"]))
        multiple = pipeline_micro_batch_multiple()
        per_micro, steps = [], []
        for epoch in range(epochs):
            seed = None if epochs == 1 else step * 1000 + seed_offset + epoch
            for idx in mini_batch_indices(batch["input_ids"].shape[0], n_mini, seed):
                full = {k: batch[k][idx] for k in keys}
                mb = {k: dp_slice(v, rank, size) for k, v in full.items()}
                zero_grads(self.state)
                n_local = mb["input_ids"].shape[0]
                mbs = micro_batch_size(n_local, micro_batch_size_per_gpu, micro_group, multiple_of=multiple)
                mb[GLOBAL_INFO_KEY] = {"dp_size": size, "num_micro_batches": n_local // mbs,
                                       **(global_info(full, size) if global_info is not None else {})}
                per_micro += forward_backward(self.state.model, mb, forward_only=False, loss_fn=loss_fn,
                                              micro_batch_size=mbs, **forward_kwargs)
                steps.append(optimizer_step(self.state))
        return per_micro, steps
