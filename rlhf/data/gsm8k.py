"""GSM8K preprocessing into the project's RL parquet schema (same layout as verl's
``examples/data_preprocess/gsm8k.py``, with ``ground_truth`` as a top-level column).

Row schema (one per problem)::

    data_source : "openai/gsm8k"
    prompt      : [{"role": "user", "content": question + " " + INSTRUCTION}]   (or a flat str)
    ground_truth: "72"              # number after "####", commas removed
    ability     : "math"
    extra_info  : {"split": "train", "index": 0, "question": ..., "answer": ...}
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

__all__ = [
    "DATA_SOURCE",
    "INSTRUCTION",
    "make_prompt_text",
    "extract_gsm8k_ground_truth",
    "gsm8k_row",
    "read_jsonl",
    "load_gsm8k_raw",
    "preprocess_gsm8k",
    "default_local_gsm8k_dir",
]

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
SPLITS = ("train", "test")


def default_local_gsm8k_dir() -> Path:
    """``<repo root>/../shared/data/gsm8k`` (the shared, read-only GSM8K copy; may not exist)."""
    return Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k"


def make_prompt_text(question: str) -> str:
    """The user turn for a GSM8K question: ``question + " " + INSTRUCTION`` (as verl)."""
    return question + " " + INSTRUCTION


def extract_gsm8k_ground_truth(answer: str) -> str:
    """The number after ``#### `` in a GSM8K reference answer, commas removed.

    ``"... #### 1,000"`` -> ``"1000"``.

    Raises:
        ValueError: no ``#### <number>`` in ``answer`` (the message shows its end).
    """
    m = _ANSWER_RE.search(answer or "")
    if m is None:
        tail = (answer or "")[-80:]
        raise ValueError(f"GSM8K answer has no '#### <number>' line: ...{tail!r}")
    return m.group(1).replace(",", "").rstrip(".")


def gsm8k_row(question: str, answer: str, split: str, index: int, flat_prompt: bool = False) -> Dict[str, Any]:
    """Convert one raw GSM8K record into the RL row schema (see module docstring).

    ``flat_prompt=True`` stores ``prompt`` as a plain string instead of a chat-message list.
    """
    content = make_prompt_text(question)
    return {
        "data_source": DATA_SOURCE,
        "prompt": content if flat_prompt else [{"role": "user", "content": content}],
        "ground_truth": extract_gsm8k_ground_truth(answer),
        "ability": "math",
        "extra_info": {"split": split, "index": int(index), "question": question, "answer": answer},
    }


def read_jsonl(path: Union[str, Path], max_rows: Optional[int] = None) -> List[Dict[str, Any]]:
    """Read a JSON-lines file (blank lines skipped) into a list of dicts.

    Raises:
        ValueError: a line is not valid JSON (message names file and line number).
    """
    rows: List[Dict[str, Any]] = []
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON line: {e}") from e
            if max_rows is not None and len(rows) >= max_rows:
                break
    return rows


def load_gsm8k_raw(
    source: str = DATA_SOURCE, local_path: Optional[Union[str, Path]] = None, max_samples: Optional[int] = None
) -> Dict[str, List[Dict[str, Any]]]:
    """Load raw GSM8K (``question``/``answer`` records) per split.

    Args:
        source: HF hub dataset id, used when ``local_path`` is None
            (``datasets.load_dataset(source, "main")``; needs network or an HF cache).
        local_path: directory holding ``train.jsonl`` and ``test.jsonl``.
        max_samples: keep only the first N records of each split.

    Returns:
        ``{"train": [...], "test": [...]}``.

    Raises:
        FileNotFoundError: ``local_path`` lacks ``train.jsonl`` / ``test.jsonl``.
    """
    out: Dict[str, List[Dict[str, Any]]] = {}
    if local_path is not None:
        root = Path(local_path)
        for split in SPLITS:
            f = root / f"{split}.jsonl"
            if not f.is_file():
                raise FileNotFoundError(
                    f"GSM8K split file {str(f)!r} not found; --local-path must be a directory with train.jsonl and test.jsonl."
                )
            out[split] = read_jsonl(f, max_rows=max_samples)
        return out
    import datasets  # heavy import, only when needed

    ds = datasets.load_dataset(source, "main")
    for split in SPLITS:
        d = ds[split]
        if max_samples is not None:
            d = d.select(range(min(max_samples, len(d))))
        out[split] = [{"question": r["question"], "answer": r["answer"]} for r in d]
    return out


def _to_rows(records: Iterable[Dict[str, Any]], split: str, flat_prompt: bool) -> List[Dict[str, Any]]:
    return [gsm8k_row(r["question"], r["answer"], split, i, flat_prompt=flat_prompt) for i, r in enumerate(records)]


def preprocess_gsm8k(
    out_dir: Union[str, Path],
    source: str = DATA_SOURCE,
    local_path: Optional[Union[str, Path]] = None,
    flat_prompt: bool = False,
    max_samples: Optional[int] = None,
) -> Dict[str, Path]:
    """Write ``out_dir/train.parquet`` and ``out_dir/test.parquet`` in the RL row schema.

    Args:
        out_dir: output directory (created if missing).
        source: HF hub id (used when ``local_path`` is None).
        local_path: directory with raw ``train.jsonl`` / ``test.jsonl``.
        flat_prompt: store ``prompt`` as a plain string instead of chat messages.
        max_samples: keep only the first N problems per split.

    Returns:
        ``{"train": Path, "test": Path}`` of the written files.
    """
    import datasets

    raw = load_gsm8k_raw(source=source, local_path=local_path, max_samples=max_samples)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: Dict[str, Path] = {}
    for split, records in raw.items():
        rows = _to_rows(records, split, flat_prompt)
        path = out / f"{split}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        paths[split] = path
        logger.info("wrote %d GSM8K %s rows to %s", len(rows), split, path)
    return paths
