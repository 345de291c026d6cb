"""Prompt dataset for RL rollouts (:class:`RLHFDataset`, verl's name; ``RLDataset`` is the old one).

Reads parquet / jsonl / json files (one or many, :mod:`rlhf.data.files`), hub datasets and in-process
datasets (:mod:`rlhf.data.sources`), renders prompts with
the tokenizer's chat template (``add_generation_prompt=True``) when it has one (plain text
otherwise, :mod:`rlhf.data.prompts`), tokenizes, and drops prompts longer than
``max_prompt_length`` (counted in ``num_filtered`` and logged). Raw GSM8K jsonl
(``question``/``answer``) is converted on the fly with the GSM8K prompt template, so
``data.train_files=../shared/data/gsm8k/train.jsonl`` works directly.  Batches come from
:class:`rlhf.data.loader.StatefulPromptLoader`; :func:`rlhf.data.collate.collate_left_pad` pads them.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from .collate import collate_left_pad
from .files import PathLike
from .prompts import normalize_row, render_prompt
from .sources import describe_sources, hub_default_data_source, iter_rows, source_label

__all__ = ["RLHFDataset", "RLDataset", "load_rl_dataset", "OVERLONG_POLICIES", "truncate"]

#: what to do with a prompt longer than max_prompt_length (data.filter_overlong_prompts / data.truncation)
OVERLONG_POLICIES = ("filter", "error", "truncate_left", "truncate_right", "truncate_middle")


def truncate(ids: List[int], max_len: int, side: str) -> List[int]:
    """`ids` cut to `max_len` tokens: ``left`` keeps the last ones, ``right`` the first, ``middle`` the first
    ``ceil(max_len/2)`` and the last ``floor(max_len/2)``."""
    if len(ids) <= max_len:
        return list(ids)
    if side == "left":
        return list(ids[-max_len:])
    if side == "right":
        return list(ids[:max_len])
    head = (max_len + 1) // 2
    return list(ids[:head]) + (list(ids[-(max_len - head):]) if max_len - head else [])

logger = logging.getLogger(__name__)


class RLHFDataset(torch.utils.data.Dataset):
    """Tokenized RL prompts.

    Args:
        files: one reference or a list (:mod:`rlhf.data.sources`): ``.parquet`` / ``.jsonl`` / ``.json``
            files or directories of them, hub datasets ``NAME[:CONFIG][@SPLIT]``, ``object://dataset/<n>``;
            rows of all of them are concatenated in order.
        tokenizer: a HF tokenizer (``apply_chat_template`` + ``__call__``).
        max_prompt_length: longest allowed prompt in tokens (after the chat template).
        prompt_key / ground_truth_key / data_source_key: column names.
        max_samples: keep only the first N prompts that pass the length filter (rows are
            tokenized lazily in chunks, so a small N on a big file is cheap).
        overlong: what to do with a prompt longer than ``max_prompt_length``:
            ``"filter"`` (drop it, counted in ``num_filtered``), ``"error"`` (raise),
            ``"truncate_left"`` / ``"truncate_right"`` / ``"truncate_middle"`` (:func:`truncate`).
        use_chat_template: ``None`` = use it iff ``tokenizer.chat_template`` is set.
        chat_template_kwargs: extra kwargs for ``apply_chat_template``.
        default_data_source: data_source for rows that lack one (a hub dataset's rows default to its name).
        label_by_source: rows still without a data_source get their file's name (``prompts`` for
            ``prompts.jsonl``; rlhf.data.sources.source_label), for reward models, which score any prompt;
            otherwise such a row raises KeyError.
        require_ground_truth: raise for a row without a ground truth (rule rewards need one).
        split: ``"train"`` or ``"val"``: the default split of a hub dataset named without ``@SPLIT``.

    Attributes:
        num_rows_read: rows examined (all rows unless ``max_samples`` stopped early).
        num_filtered: prompts dropped for exceeding ``max_prompt_length``.
        files: the sources read (local files as resolved paths, hub names and object URIs as given).

    Items (``dataset[i]``) are dicts: ``input_ids`` (list[int], unpadded), ``raw_prompt``
    (chat messages or the plain string, as stored), ``ground_truth`` (str or None),
    ``data_source``, ``index`` (row position in the concatenated input files, before
    filtering: stable and unique), ``ability``, ``extra_info`` (dict).

    Raises:
        ValueError: ``max_prompt_length < 1``, bad ``overlong``, a source without rows, every prompt
            filtered, ``use_chat_template=True`` with a tokenizer without a chat template, or an
            overlong prompt with ``overlong="error"`` (messages name the source and row).
        KeyError: a row without the prompt column, or without a ground truth when required.
        TypeError: a prompt that is neither a string nor chat messages.
    """

    _CHUNK = 1024

    def __init__(
        self,
        files: Union[PathLike, Sequence[PathLike]],
        tokenizer: Any,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        ground_truth_key: str = "ground_truth",
        data_source_key: str = "data_source",
        max_samples: Optional[int] = None,
        overlong: str = "filter",
        use_chat_template: Optional[bool] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        default_data_source: Optional[str] = None,
        require_ground_truth: bool = False,
        split: str = "train",
        label_by_source: bool = False,
    ):
        if max_prompt_length is None or int(max_prompt_length) < 1:
            raise ValueError(f"RLHFDataset: max_prompt_length={max_prompt_length!r} must be a positive int.")
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"RLHFDataset: overlong={overlong!r}; use one of {OVERLONG_POLICIES}.")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"RLHFDataset: max_samples={max_samples!r} must be >= 1 (or None for all).")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template is None:
            use_chat_template = has_template
        elif use_chat_template and not has_template:
            raise ValueError(
                "RLHFDataset: use_chat_template=True but the tokenizer has no chat_template; "
                "set tokenizer.chat_template or pass use_chat_template=False/None."
            )
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.use_chat_template = bool(use_chat_template)
        self.files = describe_sources(files)
        self.overlong = overlong
        self.num_rows_read = 0
        self.num_filtered = 0
        self.num_truncated = 0
        self.shortest_filtered: Optional[int] = None
        self._items: List[Dict[str, Any]] = []

        pending: List[Dict[str, Any]] = []
        done = False
        for global_index, (source, where, row) in enumerate(iter_rows(files, split)):
            default = default_data_source if default_data_source is not None else hub_default_data_source(source)
            if default is None and label_by_source:
                default = source_label(source)  # a reward model scores any prompt: name the file / object
            norm = normalize_row(row, prompt_key, ground_truth_key, data_source_key, default, where=where)
            if require_ground_truth and norm["ground_truth"] is None:
                raise KeyError(f"{where}no ground truth: the row has no {ground_truth_key!r} (nor "
                               f"reward_model.ground_truth) but the reward (a rule reward) needs one; keys: "
                               f"{sorted(row)}. Add the column, or score with a reward model "
                               f"(reward.sources=[{{type: model, ...}}]).")
            norm["index"], norm["where"] = global_index, where
            pending.append(norm)
            if len(pending) >= self._CHUNK:
                done = self._consume(pending, max_samples, chat_template_kwargs)
                pending = []
                if done:
                    break
        if pending and not done:
            self._consume(pending, max_samples, chat_template_kwargs)

        msg = (f"RLHFDataset: kept {len(self._items)} of {self.num_rows_read} prompts read from "
               f"{self.files}; filtered {self.num_filtered} prompts longer than "
               f"max_prompt_length={self.max_prompt_length} tokens")
        if self.num_truncated:
            msg += f"; truncated {self.num_truncated} ({overlong})"
        (logger.warning if self.num_filtered else logger.info)(msg)
        if not self._items:
            raise ValueError(
                msg + f". No prompts left: the shortest prompt has {self.shortest_filtered} tokens; raise "
                f"data.max_prompt_length to at least that, or set data.filter_overlong_prompts=false with "
                f"data.truncation=left/right/middle."
            )

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled without the tokenizer (rank 0 shares a built dataset; the others set their own)."""
        return {k: v for k, v in self.__dict__.items() if k != "tokenizer"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.tokenizer = None

    def _consume(self, rows: List[Dict[str, Any]], max_samples: Optional[int], ct_kwargs) -> bool:
        texts = [render_prompt(self.tokenizer, r["prompt"], self.use_chat_template, ct_kwargs) for r in rows]
        # Chat templates already contain the model's special tokens; plain text gets BOS etc.
        enc = self.tokenizer(texts, add_special_tokens=not self.use_chat_template)["input_ids"]
        for r, ids in zip(rows, enc):
            self.num_rows_read += 1
            ids = list(ids)
            if len(ids) > self.max_prompt_length:
                if self.overlong == "filter":
                    self.num_filtered += 1
                    self.shortest_filtered = min(len(ids), self.shortest_filtered or len(ids))
                    continue
                if self.overlong == "error":
                    raise ValueError(
                        f"RLHFDataset: {r['where']}the prompt has {len(ids)} tokens > max_prompt_length="
                        f"{self.max_prompt_length}; raise data.max_prompt_length, set "
                        f"data.filter_overlong_prompts=true, or data.truncation=left/right/middle."
                    )
                ids = truncate(ids, self.max_prompt_length, self.overlong.split("_", 1)[1])
                self.num_truncated += 1
            self._items.append({
                "input_ids": ids,
                "raw_prompt": r["prompt"],
                "ground_truth": r["ground_truth"],
                "data_source": r["data_source"],
                "index": r["index"],
                "ability": r["ability"],
                "extra_info": r["extra_info"],
            })
            if max_samples is not None and len(self._items) >= max_samples:
                return True
        return False

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id (falls back to eos id).

        Raises:
            ValueError: the tokenizer has neither.
        """
        pid = getattr(self.tokenizer, "pad_token_id", None)
        if pid is None:
            pid = getattr(self.tokenizer, "eos_token_id", None)
        if pid is None:
            raise ValueError("RLHFDataset: tokenizer has no pad_token_id or eos_token_id; set tokenizer.pad_token.")
        return int(pid)

    def collate(self, items: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        """:func:`collate_left_pad` with this tokenizer's pad id."""
        return collate_left_pad(items, self.pad_token_id)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        it = self._items[i]
        out = dict(it)
        out["input_ids"] = list(it["input_ids"])
        return out


def load_rl_dataset(
    files: Union[PathLike, Sequence[PathLike]],
    tokenizer: Any,
    max_prompt_length: int,
    prompt_key: str = "prompt",
    **kwargs: Any,
) -> RLHFDataset:
    """Build an :class:`RLHFDataset` (same arguments; see its docstring)."""
    return RLHFDataset(files, tokenizer, max_prompt_length, prompt_key=prompt_key, **kwargs)


RLDataset = RLHFDataset  # the name before the rename
