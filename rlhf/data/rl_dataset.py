"""Prompt dataset for RL rollouts, left-padding collate, and a resumable loader.

* :class:`RLDataset` / :func:`load_rl_dataset`: read parquet / jsonl / json files (one or
  many), render prompts with the tokenizer's chat template (``add_generation_prompt=True``)
  when it has one (plain text otherwise), tokenize, and drop prompts longer than
  ``max_prompt_length`` (counted in ``num_filtered`` and logged). Raw GSM8K jsonl
  (``question``/``answer``) is converted on the fly with the GSM8K prompt template, so
  ``data.train_files=../shared/data/gsm8k/train.jsonl`` works directly.
* :func:`collate_left_pad`: list of items -> left-padded ``input_ids`` / ``attention_mask``
  / ``position_ids`` tensors + lists of the other fields.
* :class:`StatefulPromptLoader`: deterministic seeded per-epoch shuffling with exact
  resumption from ``state_dict()``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch

from . import gsm8k as _gsm8k

__all__ = [
    "RLDataset",
    "load_rl_dataset",
    "collate_left_pad",
    "StatefulPromptLoader",
    "resolve_data_files",
    "read_rows",
    "normalize_row",
    "render_prompt",
]

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
_SUFFIXES = (".parquet", ".jsonl", ".json")
PathLike = Union[str, os.PathLike]


# --------------------------------------------------------------------------- files


def resolve_data_files(files: Union[PathLike, Sequence[PathLike]]) -> List[Path]:
    """Normalize ``files`` (a path, or a list/tuple of paths) to existing file paths.

    A relative path that does not exist from the CWD is also tried relative to the repo
    root, so ``../shared/data/gsm8k/train.jsonl`` works from any CWD inside the project.
    A directory expands to its ``*.parquet`` / ``*.jsonl`` / ``*.json`` files (sorted).

    Raises:
        FileNotFoundError: a path does not exist (message names it and where it was looked for).
        ValueError: no files given, or an unsupported extension.
    """
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    files = list(files)
    if not files:
        raise ValueError("resolve_data_files: no data files given.")
    out: List[Path] = []
    for f in files:
        p = Path(f).expanduser()
        if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists():
            p = REPO_ROOT / p
        if not p.exists():
            raise FileNotFoundError(
                f"data file {str(f)!r} not found (looked in CWD {os.getcwd()!r} and repo root {str(REPO_ROOT)!r})."
            )
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in _SUFFIXES)
            if not found:
                raise FileNotFoundError(f"data directory {str(p)!r} has no {_SUFFIXES} files.")
            out.extend(found)
            continue
        if p.suffix not in _SUFFIXES:
            raise ValueError(f"data file {str(p)!r}: unsupported extension {p.suffix!r}; use one of {_SUFFIXES}.")
        out.append(p)
    return out


def read_rows(path: PathLike) -> List[Dict[str, Any]]:
    """Read all rows of a ``.parquet``, ``.jsonl`` or ``.json`` (JSON array or JSON lines) file.

    Raises:
        ValueError: unsupported extension or malformed JSON (message names the file).
    """
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(str(p)).to_pylist()
    if p.suffix == ".jsonl":
        return _gsm8k.read_jsonl(p)
    if p.suffix == ".json":
        text = p.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            data = json.loads(text)
            if not all(isinstance(r, dict) for r in data):
                raise ValueError(f"{p}: expected a JSON array of objects.")
            return data
        return _gsm8k.read_jsonl(p)
    raise ValueError(f"read_rows: unsupported file type {str(p)!r}; use .parquet, .jsonl or .json.")


# --------------------------------------------------------------------------- rows


def normalize_row(
    row: Dict[str, Any],
    prompt_key: str = "prompt",
    ground_truth_key: str = "ground_truth",
    data_source_key: str = "data_source",
    default_data_source: Optional[str] = None,
    where: str = "",
) -> Dict[str, Any]:
    """Map one input row to ``{prompt, ground_truth, data_source, ability, extra_info}``.

    Accepted inputs:

    * the project schema (``prompt`` as chat messages or a plain string, ``ground_truth``);
    * verl's schema (ground truth under ``reward_model.ground_truth``);
    * raw GSM8K (``question`` + ``answer``): prompt built with the GSM8K template,
      ground truth = the ``####`` number, data_source ``"openai/gsm8k"``.

    ``ground_truth`` is None when the row has none.

    Raises:
        KeyError: no prompt (and no ``question``) field, or no data_source and no default.
        TypeError: the prompt is neither a string nor a list of ``{role, content}`` dicts.
    """
    raw_gsm8k = False
    if prompt_key in row and row[prompt_key] is not None:
        prompt = row[prompt_key]
    elif "question" in row and "answer" in row:
        prompt = [{"role": "user", "content": _gsm8k.make_prompt_text(row["question"])}]
        raw_gsm8k = True
    else:
        raise KeyError(
            f"{where}row has no {prompt_key!r} field (and is not raw GSM8K with question/answer); "
            f"keys: {sorted(row)}. Set prompt_key to the column holding the prompt."
        )
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise TypeError(f"{where}prompt must be a string or a list of {{'role','content'}} dicts, got {prompt!r:.200}.")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    elif not isinstance(prompt, str):
        raise TypeError(f"{where}prompt must be a string or a list of chat messages, got {type(prompt).__name__}.")

    gt = row.get(ground_truth_key)
    if gt is None and isinstance(row.get("reward_model"), dict):
        gt = row["reward_model"].get("ground_truth")
    if gt is None and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        gt = _gsm8k.extract_gsm8k_ground_truth(row["answer"])

    ds = row.get(data_source_key)
    if ds is None:
        ds = _gsm8k.DATA_SOURCE if raw_gsm8k else default_data_source
    if ds is None:
        raise KeyError(
            f"{where}row has no {data_source_key!r} field; add the column or pass default_data_source=..."
        )
    extra = row.get("extra_info")
    return {
        "prompt": prompt,
        "ground_truth": gt,
        "data_source": ds,
        "ability": row.get("ability", "math" if raw_gsm8k else None),
        "extra_info": dict(extra) if isinstance(extra, dict) else {},
    }


def _messages_to_plain_text(prompt: Union[str, List[Dict[str, str]]]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(m["content"] for m in prompt)


def render_prompt(tokenizer: Any, prompt: Union[str, List[Dict[str, str]]], use_chat_template: bool,
                  chat_template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """Render a prompt to text: chat template with ``add_generation_prompt=True`` (a plain
    string becomes a single user turn), or the plain text (message contents joined by a
    blank line) when ``use_chat_template`` is False."""
    if not use_chat_template:
        return _messages_to_plain_text(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )


# --------------------------------------------------------------------------- dataset


class RLDataset(torch.utils.data.Dataset):
    """Tokenized RL prompts.

    Args:
        files: one path or a list of paths (``.parquet`` / ``.jsonl`` / ``.json``), or a
            directory of them; rows of all files are concatenated in order.
        tokenizer: a HF tokenizer (``apply_chat_template`` + ``__call__``).
        max_prompt_length: longest allowed prompt in tokens (after the chat template).
        prompt_key / ground_truth_key / data_source_key: column names.
        max_samples: keep only the first N prompts that pass the length filter (rows are
            tokenized lazily in chunks, so a small N on a big file is cheap).
        overlong: what to do with a prompt longer than ``max_prompt_length``:
            ``"filter"`` (drop it, counted in ``num_filtered``), ``"error"`` (raise),
            ``"truncate_left"`` (keep its last ``max_prompt_length`` tokens).
        use_chat_template: ``None`` = use it iff ``tokenizer.chat_template`` is set.
        chat_template_kwargs: extra kwargs for ``apply_chat_template``.
        default_data_source: data_source for rows that lack one.

    Attributes:
        num_rows_read: rows examined (all rows unless ``max_samples`` stopped early).
        num_filtered: prompts dropped for exceeding ``max_prompt_length``.
        files: resolved file paths.

    Items (``dataset[i]``) are dicts: ``input_ids`` (list[int], unpadded), ``raw_prompt``
    (chat messages or the plain string, as stored), ``ground_truth`` (str or None),
    ``data_source``, ``index`` (row position in the concatenated input files, before
    filtering: stable and unique), ``ability``, ``extra_info`` (dict).

    Raises:
        ValueError: ``max_prompt_length < 1``, bad ``overlong``, every prompt filtered,
            ``use_chat_template=True`` with a tokenizer without a chat template, or an
            overlong prompt with ``overlong="error"``.
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
    ):
        if max_prompt_length is None or int(max_prompt_length) < 1:
            raise ValueError(f"RLDataset: max_prompt_length={max_prompt_length!r} must be a positive int.")
        if overlong not in ("filter", "error", "truncate_left"):
            raise ValueError(f"RLDataset: overlong={overlong!r}; use 'filter', 'error' or 'truncate_left'.")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"RLDataset: max_samples={max_samples!r} must be >= 1 (or None for all).")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template is None:
            use_chat_template = has_template
        elif use_chat_template and not has_template:
            raise ValueError(
                "RLDataset: use_chat_template=True but the tokenizer has no chat_template; "
                "set tokenizer.chat_template or pass use_chat_template=False/None."
            )
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.use_chat_template = bool(use_chat_template)
        self.files = resolve_data_files(files)
        self.overlong = overlong
        self.num_rows_read = 0
        self.num_filtered = 0
        self.num_truncated = 0
        self._items: List[Dict[str, Any]] = []

        pending: List[Dict[str, Any]] = []
        global_index = 0
        done = False
        for f in self.files:
            if done:
                break
            for r_i, row in enumerate(read_rows(f)):
                norm = normalize_row(row, prompt_key, ground_truth_key, data_source_key, default_data_source,
                                     where=f"{f}: row {r_i}: ")
                norm["index"] = global_index
                global_index += 1
                pending.append(norm)
                if len(pending) >= self._CHUNK:
                    done = self._consume(pending, max_samples, chat_template_kwargs)
                    pending = []
                    if done:
                        break
        if pending and not done:
            self._consume(pending, max_samples, chat_template_kwargs)

        msg = (f"RLDataset: kept {len(self._items)} of {self.num_rows_read} prompts read from "
               f"{[str(f) for f in self.files]}; filtered {self.num_filtered} prompts longer than "
               f"max_prompt_length={self.max_prompt_length} tokens")
        if self.num_truncated:
            msg += f"; left-truncated {self.num_truncated}"
        (logger.warning if self.num_filtered else logger.info)(msg)
        if not self._items:
            raise ValueError(
                msg + ". No prompts left: raise max_prompt_length or check the prompt column."
            )

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
                    continue
                if self.overlong == "error":
                    raise ValueError(
                        f"RLDataset: prompt index {r['index']} has {len(ids)} tokens > max_prompt_length="
                        f"{self.max_prompt_length}; raise max_prompt_length or use overlong='filter'."
                    )
                ids = ids[-self.max_prompt_length:]
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
            raise ValueError("RLDataset: tokenizer has no pad_token_id or eos_token_id; set tokenizer.pad_token.")
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
) -> RLDataset:
    """Build an :class:`RLDataset` (same arguments; see its docstring)."""
    return RLDataset(files, tokenizer, max_prompt_length, prompt_key=prompt_key, **kwargs)


# --------------------------------------------------------------------------- collate


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
    L = max_len if pad_to is None else int(pad_to)
    if L < max_len:
        raise ValueError(f"collate_left_pad: pad_to={pad_to} is shorter than the longest item ({max_len} tokens).")
    B = len(seqs)
    input_ids = torch.full((B, L), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            input_ids[b, L - len(s):] = torch.tensor(s, dtype=torch.long)
            attention_mask[b, L - len(s):] = 1
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    batch: Dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    keys: List[str] = []
    for it in items:
        for k in it:
            if k != "input_ids" and k not in keys:
                keys.append(k)
    for k in keys:
        batch[k] = [it.get(k) for it in items]
    return batch


# --------------------------------------------------------------------------- loader


class StatefulPromptLoader:
    """Deterministic, resumable batch iterator over a map-style dataset.

    Epoch ``e`` visits ``np.random.default_rng([seed, e]).permutation(len(dataset))`` (or
    ``arange`` without shuffle) in consecutive chunks of ``batch_size``. ``iter(loader)``
    yields the REST of the current epoch and then moves to the next epoch, so
    ``for epoch in range(E): for batch in loader: ...`` works and so does resuming mid-epoch.
    :meth:`next_batch` / :meth:`iter_forever` cross epoch boundaries automatically.

    ``state_dict()`` returns ``{"epoch", "step_in_epoch"}`` counting batches already
    *yielded*; a loader restored with :meth:`load_state_dict` yields exactly the batches
    the original would have yielded next (an epoch-end state is normalized to
    ``{"epoch": e + 1, "step_in_epoch": 0}``).

    Args:
        dataset: supports ``len`` and ``__getitem__``.
        batch_size: items per batch.
        shuffle: seeded permutation per epoch.
        seed: base seed.
        drop_last: drop the final partial batch of each epoch.
        collate_fn: maps a list of items to a batch; default ``dataset.collate`` if the
            dataset has it, else the list itself.

    Raises:
        ValueError: ``batch_size < 1``, empty dataset, or ``drop_last`` with fewer items
            than ``batch_size`` (no batch would ever be produced).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
    ):
        if batch_size < 1:
            raise ValueError(f"StatefulPromptLoader: batch_size={batch_size} must be >= 1.")
        n = len(dataset)
        if n == 0:
            raise ValueError("StatefulPromptLoader: dataset is empty.")
        if drop_last and n < batch_size:
            raise ValueError(
                f"StatefulPromptLoader: dataset has {n} items < batch_size={batch_size} with drop_last=True, "
                "so no batch would be produced; lower batch_size or use drop_last=False."
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        if collate_fn is None:
            collate_fn = getattr(dataset, "collate", None) or (lambda items: items)
        self.collate_fn = collate_fn
        self.epoch = 0
        self.step_in_epoch = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices visited in ``epoch`` (length ``len(dataset)``)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def batch_indices(self, epoch: int, step: int) -> List[int]:
        """Dataset indices of batch ``step`` of ``epoch``."""
        order = self.epoch_order(epoch)
        return [int(i) for i in order[step * self.batch_size:(step + 1) * self.batch_size]]

    def _normalize(self) -> None:
        if self.step_in_epoch >= len(self):
            self.epoch += 1
            self.step_in_epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self._normalize()
        epoch = self.epoch
        order = self.epoch_order(epoch)
        nb = len(self)
        while self.epoch == epoch and self.step_in_epoch < nb:
            s = self.step_in_epoch
            idx = order[s * self.batch_size:(s + 1) * self.batch_size]
            self.step_in_epoch = s + 1  # count the batch as consumed once handed out
            yield self.collate_fn([self.dataset[int(i)] for i in idx])
        self._normalize()

    def next_batch(self) -> Any:
        """The next batch, rolling over into the next epoch when needed."""
        self._normalize()
        idx = self.batch_indices(self.epoch, self.step_in_epoch)
        self.step_in_epoch += 1
        return self.collate_fn([self.dataset[i] for i in idx])

    def iter_forever(self) -> Iterator[Any]:
        """Yield batches endlessly across epochs."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, int]:
        """``{"epoch": int, "step_in_epoch": int}`` (batches already yielded in that epoch)."""
        if self.step_in_epoch >= len(self):
            return {"epoch": self.epoch + 1, "step_in_epoch": 0}
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict` (extra keys are ignored).

        Raises:
            KeyError: a required key is missing.
            ValueError: negative values or ``step_in_epoch`` beyond the epoch length.
        """
        missing = [k for k in ("epoch", "step_in_epoch") if k not in state]
        if missing:
            raise KeyError(f"StatefulPromptLoader.load_state_dict: missing keys {missing} in {state!r}.")
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or step < 0 or step > len(self):
            raise ValueError(
                f"StatefulPromptLoader.load_state_dict: invalid state {state!r} for {len(self)} batches per epoch."
            )
        self.epoch, self.step_in_epoch = epoch, step
        self._normalize()
