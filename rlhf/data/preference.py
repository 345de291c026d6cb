"""Offline preference pairs for DPO.

Row schema: ``prompt`` (plain string or chat messages), ``chosen`` (str), ``rejected``
(str); other columns are kept as-is.  Generated pairs on the embedded arithmetic task
(``embedded://preference``) come from :func:`rlhf.quickstart.arithmetic.make_synthetic_preference_dataset`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

__all__ = [
    "REQUIRED_COLUMNS",
    "load_preference_dataset",
    "write_preference_parquet",
    "encode_preference_pair",
    "encode_preference_pairs",
]

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected")
PathLike = Union[str, Path]


def load_preference_dataset(
    files: Union[PathLike, Sequence[PathLike]], max_samples: Optional[int] = None
) -> List[Dict[str, Any]]:
    """Read preference pairs from parquet / jsonl / json files (concatenated in order).

    Args:
        files: one path, a list of paths, or a directory (see ``resolve_data_files``).
        max_samples: keep only the first N pairs.

    Returns:
        List of row dicts with at least ``prompt``, ``chosen``, ``rejected``; chat-message
        prompts are returned as lists of ``{"role", "content"}`` dicts.

    Raises:
        KeyError: a row lacks a required column (message names the file, row and keys).
        ValueError: ``chosen`` or ``rejected`` is not a string, or they are identical.
    """
    from .files import read_rows, resolve_data_files

    out: List[Dict[str, Any]] = []
    for f in resolve_data_files(files):
        for i, row in enumerate(read_rows(f)):
            missing = [c for c in REQUIRED_COLUMNS if c not in row or row[c] is None]
            if missing:
                raise KeyError(
                    f"{f}: row {i}: missing preference column(s) {missing}; found keys {sorted(row)}. "
                    f"Preference data needs {list(REQUIRED_COLUMNS)}."
                )
            for c in ("chosen", "rejected"):
                if not isinstance(row[c], str):
                    raise ValueError(f"{f}: row {i}: {c!r} must be a string, got {type(row[c]).__name__}.")
            if row["chosen"] == row["rejected"]:
                raise ValueError(f"{f}: row {i}: chosen and rejected are identical; a pair must differ.")
            p = row["prompt"]
            if isinstance(p, (list, tuple)):
                row = dict(row, prompt=[{"role": m["role"], "content": m["content"]} for m in p])
            out.append(row)
            if max_samples is not None and len(out) >= max_samples:
                return out
    return out


def write_preference_parquet(rows: Sequence[Dict[str, Any]], path: PathLike) -> Path:
    """Write preference rows to a parquet file (parent directories created)."""
    import datasets

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(list(rows)).to_parquet(str(p))
    return p


def encode_preference_pair(
    tokenizer: Any,
    prompt: Union[str, List[Dict[str, str]]],
    chosen: str,
    rejected: str,
    max_length: Optional[int] = None,
    add_eos: bool = True,
) -> Dict[str, List[int]]:
    """Tokenize a pair for DPO: the prompt (chat template with generation prompt when the
    tokenizer has one) and each response (EOS appended if ``add_eos``).

    Returns:
        ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (lists of ints). Responses are
        cut so that ``len(prompt_ids) + len(response_ids) <= max_length`` when given.

    Raises:
        ValueError: the prompt alone is at least ``max_length`` tokens.
    """
    from .prompts import render_prompt

    use_ct = bool(getattr(tokenizer, "chat_template", None))
    text = render_prompt(tokenizer, prompt, use_ct)
    prompt_ids = list(tokenizer(text, add_special_tokens=not use_ct)["input_ids"])
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []

    def enc(resp: str) -> List[int]:
        ids = list(tokenizer(resp, add_special_tokens=False)["input_ids"]) + eos
        if max_length is not None:
            ids = ids[: max_length - len(prompt_ids)]
        return ids

    if max_length is not None and len(prompt_ids) >= max_length:
        raise ValueError(
            f"encode_preference_pair: prompt has {len(prompt_ids)} tokens >= max_length={max_length}; "
            "raise max_length or filter long prompts."
        )
    return {"prompt_ids": prompt_ids, "chosen_ids": enc(chosen), "rejected_ids": enc(rejected)}


def encode_preference_pairs(tokenizer: Any, rows: Sequence[Dict[str, Any]], max_prompt_length: int,
                            max_response_length: int) -> List[Dict[str, List[int]]]:
    """:func:`encode_preference_pair` of every row, responses (EOS included) cut to
    ``max_response_length`` tokens; pairs whose prompt is longer than ``max_prompt_length`` are dropped.

    Raises:
        ValueError: no pair has a prompt within ``max_prompt_length`` (the message names the setting).
    """
    out = []
    for r in rows:
        e = encode_preference_pair(tokenizer, r["prompt"], r["chosen"], r["rejected"])
        if len(e["prompt_ids"]) <= max_prompt_length:
            out.append({k: v[:max_response_length] if k != "prompt_ids" else v for k, v in e.items()})
    if not out:
        raise ValueError(f"no preference pair has a prompt within data.max_prompt_length={max_prompt_length}")
    return out
