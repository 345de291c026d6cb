"""What the actor and the critic share: a megatron model on every trainer rank, a no-grad forward
over the data-parallel split, and the ONE mini-batch update loop.

Every method is collective over the whole trainer job: each data-parallel rank works on its slice
of the batch, and results are all-gathered so every rank holds full-batch tensors.

Devices: a role's public methods that take a ``batch`` are its doors (:func:`role_entry`, applied to every such
method of a subclass by construction): the batch is moved to the role's device (`parallel.distributed.
compute_device()`) once when it comes in, the result goes back to the device of the caller's batch when it goes
out.  So the trainer works on host tensors, a role on device tensors, and the data-parallel gathers of a role's
outputs get tensors on the device of megatron's groups (parallel.devices).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from contextlib import contextmanager
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from parallel import devices, distributed
from parallel.forward import forward_backward
from parallel.optim import optimizer_step, zero_grads

from .batch import MODEL_KEYS, dp_info, dp_slice, micro_batch_size, mini_batch_indices, pipeline_micro_batch_multiple
from .dynamic_batch import PaddingCounter, compact_rows, expand_routing, expand_rows, partition_by_token_budget

__all__ = ["MegatronWorker", "gather_metrics", "summarize_metrics", "reduce_metrics", "step_metrics", "GLOBAL_INFO_KEY",
           "LOSS_TOKENS_KEY", "MICRO_SHARE_KEY", "padding_metrics", "role_entry"]

#: key of the micro batch dict that carries the whole mini batch's counts to the loss function:
#: ``{"dp_size", "num_micro_batches", ...}`` plus what the loss's ``global_info`` returned (see
#: :meth:`MegatronWorker.train_mini_batches`)
GLOBAL_INFO_KEY = "global_info"
#: key of a micro batch's metrics dict: its number of valid loss tokens, the weight of its token-mean metrics
#: (:func:`gather_metrics`); not reported itself
LOSS_TOKENS_KEY = "_loss_tokens"
#: key of a micro batch's metrics dict set by the update loop: 1 / the number of micro batches this rank ran for the
#: mini batch, the weight of its other metrics (:func:`summarize_metrics`); not reported itself
MICRO_SHARE_KEY = "_micro_share"


def summarize_metrics(per_micro: list[dict], token_means: Sequence[str] = ()) -> dict:
    """One rank's share of :func:`gather_metrics`: ``{name: (weighted sum, weight)}``.  A metric named in
    `token_means` is a micro batch's mean over its valid loss tokens and is weighted by their number (the micro
    batch's ``LOSS_TOKENS_KEY`` entry: sum = that mean x tokens = the micro batch's masked sum); any other is
    weighted by the micro batch's ``MICRO_SHARE_KEY`` entry, 1 / k for one of the k micro batches its rank ran
    for the mini batch (1 without one).

    Why 1 / k: a loss metric (actor/pg_loss, actor/entropy, actor/kl_loss, critic/vf_loss, dpo/loss) is the micro
    batch's share of the mini batch's loss x k (rlhf.workers.losses, "the x n_micro rule"), so over the D ranks
    sum(value / k) = D x the mini batch's loss and the weights sum to D: the weighted mean is the loss itself,
    also when ranks run different numbers of micro batches (dynamic batching), where a plain mean over micro
    batches weights each rank by its k (k_r x its share, / sum k) and is off.  With equal k it is the plain mean."""
    out: dict = {}
    for m in per_micro:
        tokens = float(m.get(LOSS_TOKENS_KEY, 0.0))
        share = float(m.get(MICRO_SHARE_KEY, 1.0))
        for k, v in m.items():
            if k in (LOSS_TOKENS_KEY, MICRO_SHARE_KEY):
                continue
            w = tokens if k in token_means else share
            total, weight = out.get(k, (0.0, 0.0))
            out[k] = (total + (float(v) * w if w else 0.0), weight + w)
    return out


def reduce_metrics(parts: Sequence[dict]) -> dict:
    """Combine :func:`summarize_metrics` of every rank: sum of the weighted sums / sum of the weights (0.0 for a
    token mean without a single valid token)."""
    merged: dict = {}
    for part in parts:
        for k, (total, weight) in (part or {}).items():
            t, w = merged.get(k, (0.0, 0.0))
            merged[k] = (t + total, w + weight)
    return {k: (t / w if w else 0.0) for k, (t, w) in merged.items()}


def gather_metrics(per_micro: list[dict], token_means: Sequence[str] = ()) -> dict:
    """Collective.  Each metric over the micro batches of every rank that has it (the last PP stage): the mean, or,
    for the metrics named in `token_means` (token means such as ``actor/pg_clipfrac``, ``actor/ppo_kl``), the
    token-weighted mean (:func:`summarize_metrics`): sum over micro batches and ranks of the masked sums / the
    valid loss tokens, the same for any cut into micro batches and data-parallel ranks, a micro batch without
    loss tokens adding nothing.  (A plain mean of micro batch means depends on the cut: 0.389 for a mini batch in
    one micro batch, 0.344 for the same tokens in micro batches of one row, tests/unit/workers/
    test_update_split_invariance.py.)"""
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, summarize_metrics(per_micro, token_means))
    return reduce_metrics(objs)


def step_metrics(role: str, steps: list) -> dict:
    """Metrics of a role's optimizer steps (parallel.optim.StepResult): <role>/grad_norm (mean pre-clip
    norm), <role>/num_skipped_steps (non-finite gradient norm: the update was skipped),
    <role>/num_breaker_events (the gradient circuit breaker restarted the LR warm-up), <role>/lr (the LR the
    update's last optimizer step used, read before the scheduler stepped: verl's actor/lr, critic/lr)."""
    return {f"{role}/grad_norm": float(np.mean([s.grad_norm for s in steps])),
            f"{role}/lr": float(steps[-1].lr),
            f"{role}/num_skipped_steps": float(sum(s.skipped for s in steps)),
            f"{role}/num_breaker_events": float(sum(s.breaker is not None for s in steps))}


def padding_metrics(workers) -> dict:
    """``perf/padding_efficiency`` (real tokens / tokens processed, over every model pass of `workers` since the
    last call, all data-parallel ranks: each rank counts its own slice) and, when dynamic batching ran,
    ``perf/packing_fallback_micro_batches`` (micro batches run as compacted padded rows instead of megatron's
    packed THD sequences, rlhf.workers.dynamic_batch).  Collective.  Resets the workers' counters."""
    counts = torch.tensor([0, 0, 0], dtype=torch.float64)
    for w in workers:
        if w is not None:
            counts += torch.tensor(w.padding.take(), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        _, size, group = dp_info()
        if size > 1:  # built on the host: to the DP group's device first (cuda under NCCL)
            counts = devices.to_group_device(counts, group)
            dist.all_reduce(counts, group=group)
    real, processed, fallback = counts.tolist()
    out = {"perf/padding_efficiency": real / processed if processed else 1.0}
    if fallback:
        out["perf/packing_fallback_micro_batches"] = fallback
    return out


def _shares(per_micro: list[dict]) -> list[dict]:
    """The metrics of the micro batches of one rank's mini batch, each with ``MICRO_SHARE_KEY`` = 1 / their number
    (:func:`summarize_metrics`); none on a rank that reports no metrics (not the last pipeline stage)."""
    return [{**m, MICRO_SHARE_KEY: 1.0 / len(per_micro)} for m in per_micro]


@contextmanager
def _grad_sync_unless(model, last: bool):
    """Around one megatron schedule call of several that make one optimizer step: unless `last`, switch off the
    config's finalize_model_grads (data-parallel gradient reduction, tied-embedding and sequence-parallel
    all-reduces) so it runs once, after the last call, on the whole accumulated gradient."""
    config = getattr(model[0], "config", None) if model else None
    if last or config is None:
        yield
        return
    saved = config.finalize_model_grads_func
    config.finalize_model_grads_func = None
    try:
        yield
    finally:
        config.finalize_model_grads_func = saved


def role_entry(method: Callable) -> Callable:
    """The door of a role method ``method(self, batch, ...)``: `batch` (a dict of tensors and other values) is moved
    to ``self.device`` once (parallel.devices.to_device: no copy for tensors already there), and the tensors in
    what the method returns (a tensor, or dicts / lists of them) go back to the device of the caller's batch
    (``batch["input_ids"]``, else its first tensor; a batch without tensors leaves the results where they are).  :class:`MegatronWorker` applies it to every public method of a subclass whose first
    argument is ``batch``, so no role computes on a batch that skipped it."""
    if getattr(method, "_role_entry", False):
        return method

    @functools.wraps(method)
    def door(self, batch, *args, **kwargs):
        caller = _caller_device(batch)
        out = method(self, devices.to_device(batch, self.device), *args, **kwargs)
        return out if caller is None else devices.to_device(out, caller)

    door._role_entry = True
    return door


def _caller_device(batch):
    """The device of the caller's batch: ``batch["input_ids"]``'s, else its first tensor's, else None."""
    if isinstance(batch, dict):
        first = batch.get("input_ids")
        if not isinstance(first, torch.Tensor):
            first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        return None if first is None else first.device
    return batch.device if isinstance(batch, torch.Tensor) else None


def _needs(*parts: str) -> Callable:
    """A building block that runs with the role's `parts` on its device (:meth:`MegatronWorker.resident`): with
    offload on they are loaded first and the role's offloaded parts leave again when the outermost one returns."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with self.resident(*parts):
                return method(self, *args, **kwargs)
        return run
    return wrap


def _takes_batch(fn) -> bool:
    params = list(inspect.signature(fn).parameters)
    return len(params) > 1 and params[1] == "batch"


class MegatronWorker:
    """A megatron model (`bundle`: parallel.models.ModelBundle) and, when it trains, its
    `state` (parallel.optim.TrainState: DDP chunks, optimizer, LR scheduler), computing on `device`
    (default `parallel.distributed.compute_device()`).

    Every public method of a subclass taking ``batch`` first is a door (:func:`role_entry`): batches come in
    on `device`, results go out on the caller's device.  The methods here (:meth:`forward`,
    :meth:`train_mini_batches`) are the building blocks of those doors and expect a batch on `device`.

    `forward_max_tokens` (dynamic batching, rlhf.workers.dynamic_batch): the no-grad forward cuts micro batches
    by this token budget instead of `forward_micro_batch_size` rows.  `padding` counts real and processed
    tokens (:func:`padding_metrics`).  `offload` (parallel.offload.RoleOffload, None: off) moves the role's
    parameters / gradients / optimizer state off the device outside :meth:`forward` and
    :meth:`train_mini_batches` (and :meth:`resident` blocks of other users: weight sync, checkpoints)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, fn in list(vars(cls).items()):
            if not name.startswith("_") and inspect.isfunction(fn) and _takes_batch(fn):
                setattr(cls, name, role_entry(fn))

    def __init__(self, bundle, state=None, *, forward_micro_batch_size: int, forward_max_tokens: int | None = None,
                 device: torch.device | None = None):
        self.bundle, self.state = bundle, state
        self.device = distributed.compute_device() if device is None else torch.device(device)
        self.forward_micro_batch_size = forward_micro_batch_size
        self.forward_max_tokens = forward_max_tokens
        self.padding = PaddingCounter()
        self.offload = None

    def resident(self, *parts: str):
        """Context manager: the role's `parts` (``params``, ``grads``, ``optimizer``; none named: all) on its device
        inside the block, offloaded again after the outermost block (parallel.offload.RoleOffload.resident); a
        no-op without offload."""
        return contextlib.nullcontext() if self.offload is None else self.offload.resident(*parts)

    @staticmethod
    def _refuse_dynamic_under_vpp(multiple: int) -> None:
        if multiple > 1:
            raise ValueError("dynamic batching (actor/critic.use_dynamic_bsz) cuts micro batches of different "
                             "shapes, which megatron's interleaved (virtual) pipeline schedule cannot run; unset "
                             "parallel.virtual_pipeline_model_parallel_size or set use_dynamic_bsz=false")

    def _dynamic_forward(self, local: dict, max_tokens: int, **forward_kwargs) -> dict:
        """No-grad forward of this rank's rows in token-budget micro batches, outputs in the [n, S] layout."""
        S = local["input_ids"].shape[1]
        parts = partition_by_token_budget(local["attention_mask"].sum(1).tolist(), max_tokens)
        out = {}
        for rows in parts:
            idx = torch.tensor(rows, device=local["input_ids"].device)
            mb, index = compact_rows({k: v[idx] for k, v in local.items()})
            self.padding.add(mb["attention_mask"], mb["input_ids"].numel(), fallback=True)
            res = forward_backward(self.chunks, mb, micro_batch_size=len(rows), **forward_kwargs)
            for k, v in res.items():
                if k == "routed_experts":  # MoE routing replay: [rows, L, layers, k]
                    if k not in out:
                        out[k] = v.new_zeros(local["input_ids"].shape[0], S, *v.shape[2:])
                    out[k][idx.to(v.device)] = expand_routing(v, index, S)
                    continue
                if k not in out:
                    out[k] = v.new_zeros(local["input_ids"].shape[0], S)
                out[k][idx.to(v.device)] = expand_rows(v, index, S)
        return out

    @property
    def chunks(self) -> list:
        """The model's GPTModel chunks (one per virtual pipeline stage on this rank)."""
        return self.bundle.chunks

    @property
    def vocab_size(self) -> int:
        """Unpadded vocabulary size of the model."""
        return self.bundle.spec.vocab_size

    @_needs("params")
    def forward(self, batch: dict, *, extra_keys: Sequence[str] = (), **forward_kwargs) -> dict:
        """No-grad forward of this rank's data-parallel slice of `batch` (MODEL_KEYS) in micro batches
        of at most `forward_micro_batch_size`; returns the local [N / dp, P + R] outputs of
        parallel.forward.forward_backward (`log_probs` / `entropy` / `values`).  Under virtual pipeline
        stages the number of micro batches is a multiple of the pipeline size (megatron's interleaved
        schedule): a slice that does not split so is padded with copies of its last row, whose outputs
        are dropped.  `extra_keys`: batch tensors the model needs besides MODEL_KEYS (``routed_experts``)."""
        rank, size, _ = dp_info()
        local = {k: dp_slice(batch[k], rank, size) for k in (*MODEL_KEYS, *extra_keys)}
        n, multiple = local["input_ids"].shape[0], pipeline_micro_batch_multiple()
        if self.forward_max_tokens:
            self._refuse_dynamic_under_vpp(multiple)
            with torch.no_grad():
                return self._dynamic_forward(local, self.forward_max_tokens, **forward_kwargs)
        self.padding.add(local["attention_mask"], local["input_ids"].numel())
        pad = (-n) % multiple
        if pad:
            local = {k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])], 0) for k, v in local.items()}
        with torch.no_grad():
            out = forward_backward(self.chunks, local, micro_batch_size=micro_batch_size(
                n + pad, self.forward_micro_batch_size, multiple_of=multiple), **forward_kwargs)
        return {k: v[:n] for k, v in out.items()} if pad else out

    @_needs("params", "grads", "optimizer")
    def train_mini_batches(self, batch: dict, keys: Sequence[str], loss_fn: Callable, *, mini_batch_size: int,
                           micro_batch_size_per_gpu: int, epochs: int, step: int, seed_offset: int = 0,
                           micro_group: int = 1, global_info: Callable | None = None,
                           max_tokens_per_micro_batch: int | None = None, shuffle: bool = False,
                           **forward_kwargs) -> tuple[list[dict], list]:
        """The mini-batch update loop (verl's / PPO's): `epochs` passes over the batch, one optimizer
        step per mini batch of `mini_batch_size` prompts (x batch["n"] sequences), gradients
        accumulated over micro batches of at most `micro_batch_size_per_gpu` sequences (whole groups
        of `micro_group` rows; under virtual pipeline stages a multiple of the pipeline size of them).
        With several epochs, or with `shuffle` (verl's ``actor.shuffle`` / ``critic.shuffle``), each pass
        visits the rows (whole groups of `micro_group`) in a permutation seeded by
        `step * 1000 + seed_offset + epoch`, so a mini batch mixes rows of many prompts; with one epoch
        and no `shuffle`, in order (a mini batch is ``mini_batch_size`` whole prompt groups).
        `loss_fn(outputs, micro_batch) -> (loss, metrics)` sees the micro batch's `keys` and, under
        GLOBAL_INFO_KEY, the counts that make its loss independent of the split (rlhf.algorithms.agg_loss, "the x n_micro rule"):
        ``dp_size``, ``num_micro_batches`` (of this rank in this mini batch; megatron divides each micro
        batch loss by it, so a loss function multiplies by it) and ``global_info(full_mini_batch,
        dp_size)`` computed on the WHOLE mini batch (every data-parallel rank's rows, `keys` only)
        before it is split.

        With `max_tokens_per_micro_batch` (dynamic batching, rlhf.workers.dynamic_batch) micro batches are cut
        by that token budget instead (rows sorted by length, compacted) and `loss_fn` sees its outputs expanded
        back to the batch layout, so losses need no change; ``num_micro_batches`` is then the number of token
        micro batches.

        Returns (per-micro-batch metrics of this rank, parallel.optim.StepResult of every optimizer step).
        """
        rank, size, _ = dp_info()
        n_mini = max(1, batch["input_ids"].shape[0] // (mini_batch_size * batch["n"]))
        multiple = pipeline_micro_batch_multiple()
        per_micro, steps = [], []
        for epoch in range(epochs):
            seed = None if epochs == 1 and not shuffle else step * 1000 + seed_offset + epoch
            for idx in mini_batch_indices(batch["input_ids"].shape[0], n_mini, seed, micro_group):
                full = {k: batch[k][idx] for k in keys}
                mb = {k: dp_slice(v, rank, size) for k, v in full.items()}
                zero_grads(self.state)
                n_local = mb["input_ids"].shape[0]
                if max_tokens_per_micro_batch:
                    self._refuse_dynamic_under_vpp(multiple)
                    per_micro += _shares(self._dynamic_update(mb, full, size, loss_fn, global_info, micro_group,
                                                              max_tokens_per_micro_batch, **forward_kwargs))
                    steps.append(optimizer_step(self.state))
                    continue
                self.padding.add(mb["attention_mask"], mb["input_ids"].numel())
                mbs = micro_batch_size(n_local, micro_batch_size_per_gpu, micro_group, multiple_of=multiple)
                mb[GLOBAL_INFO_KEY] = {"dp_size": size, "num_micro_batches": n_local // mbs,
                                       **(global_info(full, size) if global_info is not None else {})}
                per_micro += _shares(forward_backward(self.state.model, mb, forward_only=False, loss_fn=loss_fn,
                                                      micro_batch_size=mbs, **forward_kwargs))
                steps.append(optimizer_step(self.state))
        return per_micro, steps

    def _dynamic_update(self, mb: dict, full: dict, dp_size: int, loss_fn: Callable, global_info: Callable | None,
                        micro_group: int, max_tokens: int, **forward_kwargs) -> list[dict]:
        """Forward/backward of one mini batch's local rows `mb` in token-budget micro batches, one megatron
        schedule call each; the gradient reduction runs once, after the last (:func:`_grad_sync_unless`).
        Each call is one micro batch for megatron (it divides by 1), so the loss, which multiplies by
        ``num_micro_batches`` (k), is divided by k here: the sum over calls is the mini batch's loss."""
        S = mb["input_ids"].shape[1]
        parts = partition_by_token_budget(mb["attention_mask"].sum(1).tolist(), max_tokens, micro_group)
        k = len(parts)
        info = {"dp_size": dp_size, "num_micro_batches": k, **(global_info(full, dp_size) if global_info else {})}
        per_micro = []
        for i, rows in enumerate(parts):
            idx = torch.tensor(rows, device=mb["input_ids"].device)
            part, index = compact_rows({key: v[idx] for key, v in mb.items()})
            part[GLOBAL_INFO_KEY] = info
            self.padding.add(part["attention_mask"], part["input_ids"].numel(), fallback=True)

            def expanded_loss(outs, micro, index=index):
                loss, metrics = loss_fn({key: expand_rows(v, index, S) for key, v in outs.items()}, micro)
                return loss / k, metrics

            with _grad_sync_unless(self.state.model, last=i == k - 1):
                per_micro += forward_backward(self.state.model, part, forward_only=False, loss_fn=expanded_loss,
                                              micro_batch_size=len(rows), **forward_kwargs)
        return per_micro
