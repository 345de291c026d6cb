"""Padding: the one helper that turns variable-length token lists into padded tensors, and the
left-padding collate of prompt batches built on it."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["pad_sequences", "position_ids_from_mask", "collate_left_pad", "collate_prompts"]


def pad_sequences(seqs: Sequence[Sequence[Any]], pad_value: Any, *, side: str = "left",
                  length: Optional[int] = None, dtype: torch.dtype = torch.long) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pad B variable-length sequences into one tensor.

    Args:
        seqs: B sequences (lists or 1-D tensors) of numbers.
        pad_value: written into padded positions.
        side: ``"left"`` (real entries end at the last column: prompts) or ``"right"`` (real
            entries start at column 0: responses, labels).
        length: L, the padded length; default the longest sequence.
        dtype: dtype of the values tensor.

    Returns:
        ``(values, mask)``: ``values`` [B, L] of ``dtype``; ``mask`` [B, L] int64, 1 on real entries.

    Raises:
        ValueError: unknown ``side``, or ``length`` shorter than the longest sequence (the
            message names both).
    """
    if side not in ("left", "right"):
        raise ValueError(f"pad_sequences: side={side!r}; use 'left' or 'right'.")
    longest = max((len(s) for s in seqs), default=0)
    L = longest if length is None else int(length)
    if L < longest:
        raise ValueError(f"pad_sequences: length={length} is shorter than the longest sequence ({longest}).")
    values = torch.full((len(seqs), L), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        n = len(s)
        if n:
            cols = slice(L - n, L) if side == "left" else slice(0, n)
            values[b, cols] = torch.as_tensor(s, dtype=dtype)
            mask[b, cols] = 1
    return values, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, L] for a padded batch: 0 at each row's first real token, counting real
    tokens only (``clamp(cumsum(mask) - 1, 0)``; pads before the first token get 0)."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def collate_left_pad(
    items: Sequence[Dict[str, Any]], pad_token_id: int, pad_to: Optional[int] = None
) -> Dict[str, Any]:
    """Left-pad a list of items into a batch.

    Args:
        items: dicts each with ``input_ids`` (list[int] or 1-D tensor); every other key is
            collected into a list (one entry per item, in order).
        pad_token_id: id written into padded positions.
        pad_to: pad to this length instead of the longest item.

    Returns:
        ``input_ids`` LongTensor (B, L), left-padded; ``attention_mask`` LongTensor (B, L),
        1 on real tokens; ``position_ids`` LongTensor (B, L) = ``clamp(cumsum(mask) - 1, 0)``
        (first real token at position 0, pads at 0); plus ``key -> list`` for other keys.

    Raises:
        ValueError: empty ``items``, an item without ``input_ids``, or ``pad_to`` shorter
            than the longest item.
    """
    if not items:
        raise ValueError("collate_left_pad: got an empty list of items.")
    seqs = []
    for i, it in enumerate(items):
        if "input_ids" not in it:
            raise ValueError(f"collate_left_pad: item {i} has no 'input_ids' (keys: {sorted(it)}).")
        ids = it["input_ids"]
        seqs.append(ids.tolist() if isinstance(ids, torch.Tensor) else list(ids))
    max_len = max(len(s) for s in seqs)
    if pad_to is not None and int(pad_to) < max_len:
        raise ValueError(f"collate_left_pad: pad_to={pad_to} is shorter than the longest item ({max_len} tokens).")
    input_ids, attention_mask = pad_sequences(seqs, int(pad_token_id), side="left", length=pad_to)
    position_ids = position_ids_from_mask(attention_mask)
    batch: Dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    keys: List[str] = []
    for it in items:
        for k in it:
            if k != "input_ids" and k not in keys:
                keys.append(k)
    for k in keys:
        batch[k] = [it.get(k) for it in items]
    return batch


def collate_prompts(items: Sequence[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """RLHFDataset items -> the rollout's prompt batch, lists of length B: ``input_ids_list`` (token ids,
    unpadded: the engine takes them as they are), ``data_source``, ``ground_truth``, ``extra_info``
    ({} when missing), ``index``, ``raw_prompt``."""
    return {"input_ids_list": [list(it["input_ids"]) for it in items],
            "data_source": [it["data_source"] for it in items], "ground_truth": [it["ground_truth"] for it in items],
            "extra_info": [it.get("extra_info") or {} for it in items], "index": [it["index"] for it in items],
            "raw_prompt": [it.get("raw_prompt") for it in items]}
