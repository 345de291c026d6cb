"""Where rows come from: every data reference of ``data.train_files`` / ``data.val_files`` (rlhf.data.refs)
as one stream of ``(where, row)`` pairs, `where` naming the file / dataset and row for error messages.

    /data/train.parquet, data/dir/, x.jsonl   local files (rlhf.data.files.read_rows)
    openai/gsm8k:main@test                    datasets.load_dataset("openai/gsm8k", "main", split="test"), read
                                              from the local HF cache when HF_DATASETS_OFFLINE=1
    object://dataset/<n>                      a datasets.Dataset or list of row dicts given to rlhf.Trainer

Without ``@SPLIT`` a hub dataset gives split ``train`` for the train files and ``test`` (else ``validation``)
for the validation files (rlhf.data.refs.DEFAULT_SPLITS).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Sequence, Tuple, Union

from rlhf.config.objects import get_object
from rlhf.data.refs import DEFAULT_SPLITS, parse_data_ref

from .files import read_rows, resolve_data_files

__all__ = ["iter_rows", "describe_sources", "hub_default_data_source", "source_label"]

Ref = Union[str, os.PathLike]


def _refs(refs: Union[Ref, Sequence[Ref]]) -> List[str]:
    items = [refs] if isinstance(refs, (str, os.PathLike)) else list(refs)
    if not items:
        raise ValueError("no data given: data.train_files / data.val_files is empty")
    return [os.fspath(r) for r in items]


def _load_hub(name: str, config: Any, split: Any, which: str):
    import datasets

    label = f"{name}{':' + config if config else ''}"
    splits = [split] if split else list(DEFAULT_SPLITS["train" if which == "train" else "val"])
    last = None
    for s in splits:
        try:
            return datasets.load_dataset(name, config, split=s), s
        except ValueError as e:  # an unknown split (or config): try the next default split
            last = e
    raise ValueError(f"hub dataset {label}: cannot load split {' or '.join(map(repr, splits))}: {last}; name the "
                     f"split as {label}@SPLIT") from last


def _rows_of(obj: Any, uri: str) -> Iterator[Dict[str, Any]]:
    if isinstance(obj, (list, tuple)):
        return iter(obj)
    if hasattr(obj, "column_names"):
        return iter(obj)
    raise TypeError(f"{uri}: a dataset object is a datasets.Dataset or a list of row dicts, got {type(obj).__name__}")


def iter_rows(refs: Union[Ref, Sequence[Ref]], which: str = "train") -> Iterator[Tuple[str, str, Dict[str, Any]]]:
    """Yield ``(source, where, row)`` for every row of every reference in order: `source` is the reference
    (file path, hub name, object URI), `where` a prefix for messages (``"<file>: row 3: "``).  `which` is
    ``"train"`` or ``"val"`` (default hub split).

    Raises:
        FileNotFoundError: a local path does not exist.  ValueError: a reference that is not data (an
        ``embedded://`` task must be resolved first), an unknown hub split, or a source without rows.
        KeyError: an ``object://`` URI of another process.
    """
    for ref in _refs(refs):
        parsed = parse_data_ref(ref)
        if parsed.kind == "hub":
            ds, split = _load_hub(parsed.path, parsed.config, parsed.split, which)
            label = f"{parsed.path}{':' + parsed.config if parsed.config else ''}@{split}"
            sources = [(parsed.path, label, iter(ds), len(ds))]
        elif parsed.kind == "object":
            obj = get_object(parsed.path)
            sources = [(parsed.path, parsed.path, _rows_of(obj, parsed.path), len(obj))]
        elif parsed.kind in ("local", "invalid") and not ref.startswith("embedded://"):
            sources = []
            for f in resolve_data_files(ref):
                rows = read_rows(f)
                sources.append((str(f), str(f), iter(rows), len(rows)))
        else:
            raise ValueError(f"data reference {ref!r} is not a file, directory, hub dataset or in-process dataset "
                             f"(embedded:// tasks are resolved by the trainer)")
        for source, label, rows, n in sources:
            if n == 0:
                raise ValueError(f"{label}: the dataset has no rows; give a file or split with data")
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise TypeError(f"{label}: row {i}: expected a dict of columns, got {type(row).__name__}")
                yield source, f"{label}: row {i}: ", row


def hub_default_data_source(source: str) -> Any:
    """The data_source of a row without one: the hub dataset's name (``openai/gsm8k`` picks the GSM8K rule
    reward), None for files and objects."""
    return source if parse_data_ref(source).kind == "hub" else None


def source_label(source: str) -> str:
    """A short data_source for rows that have none and need no rule reward: a hub dataset's name, a file's name
    without its extension (``prompts`` for ``/data/prompts.jsonl``), ``dataset`` for an in-process object."""
    kind = parse_data_ref(source).kind
    if kind == "hub":
        return source
    return "dataset" if kind == "object" else os.path.splitext(os.path.basename(source))[0]


def describe_sources(refs: Union[Ref, Sequence[Ref]]) -> List[str]:
    """The references as written, local directories expanded to their files (for messages)."""
    out = []
    for ref in _refs(refs):
        kind = parse_data_ref(ref).kind
        out += [str(f) for f in resolve_data_files(ref)] if kind == "local" else [ref]
    return out
