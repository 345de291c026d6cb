"""Data files: resolve paths (files, lists, directories) and read their rows (parquet / jsonl / json)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Sequence, Union

from . import gsm8k as _gsm8k

__all__ = ["resolve_data_files", "read_rows", "REPO_ROOT", "PathLike"]

REPO_ROOT = Path(__file__).resolve().parents[2]
_SUFFIXES = (".parquet", ".jsonl", ".json")
PathLike = Union[str, os.PathLike]


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
