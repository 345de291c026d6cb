"""Training batches: token lists -> padded tensors; data-parallel slicing, gathering, mini and micro batches.

Layout of one batch of N sequences (prompts x n), P = longest prompt, R = max_response_length::

    input_ids      [N, P + R]  left-padded prompt | right-padded response
    attention_mask [N, P + R]  1 on real tokens
    position_ids   [N, P + R]  0 at the first real token
    responses      [N, R]      response token ids (pad after the end)
    response_mask  [N, R]      1 on response tokens (the stop token included); multi-turn: 0 on tool /
                               user tokens (rlhf.agent), which attention_mask keeps
    prompt_length  int         P
    n              int         sequences per prompt (rollout.n; 2 for DPO pairs): mini batches count prompts
    truncated      [N] bool    rollout batches: the engine stopped at max_response_length (finish reason
                               "length"), for ``algorithm.overlong_filter``

A PPO batch also carries ``loss_mask`` [N, R] (rlhf.trainer.advantage): the response mask without the
samples left out of the loss (unscorable rewards, overlong-filtered responses).

Padding itself is :func:`rlhf.data.collate.pad_sequences` (the project's one padding helper).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from parallel import devices
from rlhf.data.collate import pad_sequences, position_ids_from_mask

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")

__all__ = ["MODEL_KEYS", "build_batch", "build_rollout_batch", "build_pair_batch", "outcome_token_scores",
           "dp_info", "dp_slice", "dp_all_gather", "mini_batch_indices", "mini_batches", "micro_batch_size",
           "pipeline_micro_batch_multiple", "check_micro_batch_layout"]


def build_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int,
                max_response_length: int, response_log_probs: Sequence[Sequence[float]] | None = None) -> dict:
    """Pad N (prompt, response) token lists into the layout above; with `response_log_probs` (N lists of
    floats, one per response token) also `rollout_log_probs` [N, R] float32, 0 after each response.

    Raises ValueError when there is no sequence or a response is longer than max_response_length.
    """
    if not prompts:
        raise ValueError("no rollout samples to batch")
    R = max_response_length
    for r in responses:
        if len(r) > R:
            raise ValueError(f"response of {len(r)} tokens exceeds max_response_length={R}")
    prompt_ids, prompt_mask = pad_sequences(prompts, pad_token_id, side="left")
    response_ids, response_mask = pad_sequences(responses, pad_token_id, side="right", length=R)
    input_ids = torch.cat([prompt_ids, response_ids], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask,
                 position_ids=position_ids_from_mask(attention_mask), responses=response_ids,
                 response_mask=response_mask, prompt_length=prompt_ids.shape[1])
    if response_log_probs is not None:
        batch["rollout_log_probs"] = pad_sequences([lp[:len(r)] for lp, r in zip(response_log_probs, responses)], 0.0,
                                                   side="right", length=R, dtype=torch.float32)[0]
    return batch


def build_rollout_batch(samples, pad_token_id: int, max_response_length: int) -> dict:
    """Pad a list of RolloutSample into the layout above plus `rollout_log_probs` [N, R] (the
    engine's sampling log-probs) and `truncated` [N] bool (``finish_reason == "length"``: cut at
    max_response_length without a stop token).  A multi-turn sample's ``extra["response_mask"]`` (rlhf.agent: 0 on
    tool / user tokens) becomes its row of `response_mask`; `attention_mask` keeps 1 on every response token.  Raises ValueError when a response is longer than
    max_response_length."""
    batch = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_token_id,
                        max_response_length, [s.response_log_probs for s in samples])
    batch["truncated"] = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.bool)
    for k, s in enumerate(samples):  # multi-turn (rlhf.agent): tool / user tokens are in the response, mask 0
        mask = s.extra.get("response_mask") if s.extra else None
        if mask is not None:
            if len(mask) != len(s.response_ids):
                raise ValueError(f"sample {k}: response_mask of {len(mask)} entries for {len(s.response_ids)} "
                                 f"response tokens")
            batch["response_mask"][k, :len(mask)] = torch.tensor(mask, dtype=batch["response_mask"].dtype)
    if any(s.extra and s.extra.get("routed_experts") is not None for s in samples):
        batch.update(routed_experts_batch(samples, batch["prompt_length"], batch["input_ids"].shape[1]))
    return batch


def routed_experts_batch(samples, prompt_length: int, S: int) -> dict:
    """The engines' routing of each sample (``extra["routed_experts"]``: [tokens, L, k] for the prompt's tokens and
    the response's but the last, rlhf.rollout.sglang_engine.decode_routed_experts) in the batch layout:
    ``routed_experts`` [N, S, L, k] int16 aligned with ``input_ids`` (parallel.router_replay; experts 0..k-1 where
    the engine reported nothing) and ``routed_experts_mask`` [N, S] bool (where it did).
    Raises ValueError when a sample's routing is longer than its tokens."""
    from parallel.router_replay import filler

    first = next(s.extra["routed_experts"] for s in samples if s.extra and s.extra.get("routed_experts") is not None)
    L, k = first.shape[1:]
    out = filler((len(samples), S, L), k)
    mask = torch.zeros(len(samples), S, dtype=torch.bool)
    for i, s in enumerate(samples):
        r = s.extra.get("routed_experts") if s.extra else None
        if r is None:
            continue
        start = prompt_length - len(s.prompt_ids)
        n = min(len(r), S - start)
        if len(r) > len(s.prompt_ids) + len(s.response_ids):
            raise ValueError(f"sample {i}: routing of {len(r)} tokens for {len(s.prompt_ids)} prompt + "
                             f"{len(s.response_ids)} response tokens")
        out[i, start:start + n] = torch.as_tensor(r[:n]).to(out.dtype)
        mask[i, start:start + n] = True
    return {"routed_experts": out, "routed_experts_mask": mask}


def build_pair_batch(pairs: Sequence[dict], pad_token_id: int, max_response_length: int) -> dict:
    """Preference pairs (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) -> rows
    [chosen_1, rejected_1, chosen_2, ...] in the layout above, with n = 2."""
    prompts = [p["prompt_ids"] for p in pairs for _ in range(2)]
    responses = [p[k] for p in pairs for k in ("chosen_ids", "rejected_ids")]
    batch = build_batch(prompts, responses, pad_token_id, max_response_length)
    batch["n"] = 2
    return batch


def outcome_token_scores(scores, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last response token with ``response_mask`` 1 (the model's last
    token; a multi-turn response may end with tool / user tokens, mask 0): [N] -> [N, R].
    An empty response keeps its score at position 0 (masked out downstream)."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    R = response_mask.shape[1]
    last = R - 1 - torch.flip(response_mask.bool().int(), [1]).argmax(1)  # the last index where the mask is 1
    last = torch.where(response_mask.bool().any(1), last, torch.zeros_like(last))
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(len(scores)), last] = scores
    return out


def dp_info() -> tuple[int, int, object]:
    """(data-parallel rank, data-parallel size, data-parallel group) of this rank (megatron's)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


def dp_slice(t: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's contiguous slice of dim 0 (must divide evenly)."""
    n = t.shape[0]
    if n % dp_size:
        raise ValueError(f"batch of {n} sequences does not split over data-parallel size {dp_size}; "
                         f"make data.train_batch_size * rollout.n divisible by it")
    k = n // dp_size
    return t[dp_rank * k:(dp_rank + 1) * k]


def dp_all_gather(t: torch.Tensor, group, dp_size: int) -> torch.Tensor:
    """Concatenate every data-parallel rank's [k, ...] tensor along dim 0 (rank order), on the device of `group`
    (parallel.devices.group_device: where a role's outputs already are; a host tensor is copied there first)."""
    if dp_size == 1:
        return t
    t = devices.to_group_device(t.contiguous(), group)
    parts = [torch.empty_like(t) for _ in range(dp_size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, 0)


def mini_batch_indices(num_rows: int, n_mini: int, seed: int | None, group: int = 1) -> tuple:
    """Row indices of `n_mini` mini batches: `torch.chunk` of the row order -- in order, or a permutation seeded by
    `seed` of whole blocks of `group` consecutive rows (2: a DPO pair stays adjacent).

    Raises ValueError when `num_rows` is not a multiple of `group`."""
    if num_rows % group:
        raise ValueError(f"{num_rows} rows are not whole groups of {group}")
    order = torch.arange(num_rows)
    if seed is not None:
        blocks = torch.randperm(num_rows // group, generator=torch.Generator().manual_seed(seed))
        order = (blocks.unsqueeze(1) * group + torch.arange(group)).reshape(-1)
    return order.chunk(n_mini)


def mini_batches(batch: dict, keys: Sequence[str], n_mini: int, seed: int | None, dp_rank: int,
                 dp_size: int) -> Iterator[dict]:
    """`n_mini` mini batches of the batch's rows (:func:`mini_batch_indices`), each reduced to `keys` and
    to this data-parallel rank's slice."""
    for idx in mini_batch_indices(batch["input_ids"].shape[0], n_mini, seed):
        yield {k: dp_slice(batch[k][idx], dp_rank, dp_size) for k in keys}


def micro_batch_size(n_local: int, requested: int, group: int = 1, multiple_of: int = 1) -> int:
    """The largest micro batch <= `requested` sequences that divides `n_local` and holds whole groups
    of `group` consecutive rows (2: a DPO pair never straddles two micro batches); at least one group.
    With `multiple_of` > 1 (megatron's interleaved pipeline schedule: the pipeline size under virtual
    pipeline stages) the number of micro batches is also a multiple of it, the micro batch possibly
    smaller than `requested`.

    Raises ValueError when `n_local / group` is not a multiple of `multiple_of` (no split fits).
    """
    units = n_local // group
    if units % multiple_of:
        raise ValueError(f"{n_local} sequences per data-parallel rank (groups of {group}) cannot be cut into a "
                         f"multiple of {multiple_of} micro batches, which the interleaved (virtual) pipeline "
                         f"schedule needs; make the rows per rank a multiple of {multiple_of * group} "
                         f"(see check_micro_batch_layout) or unset parallel.virtual_pipeline_model_parallel_size")
    mbs = max(1, min(max(1, requested // group), units // multiple_of))
    while units % mbs or (units // mbs) % multiple_of:
        mbs -= 1
    return mbs * group


def pipeline_micro_batch_multiple() -> int:
    """What the number of micro batches must be a multiple of on this rank: the pipeline size under
    virtual pipeline stages (megatron's interleaved schedule groups micro batches by PP), else 1."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return ps.get_pipeline_model_parallel_world_size() if vpp and vpp > 1 else 1


def check_micro_batch_layout(rows: dict, dp_size: int, multiple: int, group: int = 1) -> None:
    """Refuse, before anything is built, batch sizes the interleaved pipeline schedule cannot run: each
    entry of `rows` ("<config key description>" -> sequences per step, over all data-parallel ranks) must
    give a per-rank count that is a multiple of `multiple` x `group` (`multiple`: see
    :func:`pipeline_micro_batch_multiple`).  Raises ValueError naming every bad entry and the fix."""
    if multiple <= 1:
        return
    bad = [f"{what} = {n} sequences, {n // dp_size} per data-parallel rank" for what, n in rows.items()
           if (n // dp_size) % (multiple * group)]
    if bad:
        raise ValueError(
            "parallel.virtual_pipeline_model_parallel_size is set: megatron's interleaved pipeline schedule needs a "
            f"number of micro batches that is a multiple of the pipeline size {multiple}, so every batch must hold a "
            f"multiple of {multiple * group} sequences per data-parallel rank; not so for: " + "; ".join(bad)
            + ". Change data.train_batch_size / ppo_mini_batch_size (x rollout.n) accordingly, or unset "
            "parallel.virtual_pipeline_model_parallel_size.")
