"""Offline preference pairs for DPO.

Row schema: ``prompt`` (plain string or chat messages), ``chosen`` (str), ``rejected``
(str); other columns are kept as-is.  The common hub layout (UltraFeedback-style, e.g.
``HuggingFaceH4/ultrafeedback_binarized@train_prefs``) is read too: ``chosen`` / ``rejected`` as whole
conversations (chat messages ending with the assistant's answer), the prompt in ``prompt`` or, when absent,
the messages before that answer.  Generated pairs on the embedded arithmetic task
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
    files: Union[PathLike, Sequence[PathLike]], max_samples: Optional[int] = None, split: str = "train"
) -> List[Dict[str, Any]]:
    """Read preference pairs from parquet / jsonl / json files, hub datasets or in-process datasets
    (:mod:`rlhf.data.sources`; concatenated in order).

    Args:
        files: one reference, a list, or a directory.
        max_samples: keep only the first N pairs.
        split: ``"train"`` or ``"val"``: the default split of a hub dataset named without ``@SPLIT``.

    Returns:
        List of row dicts with at least ``prompt``, ``chosen``, ``rejected``; chat-message
        prompts are returned as lists of ``{"role", "content"}`` dicts.

    Raises:
        KeyError: a row lacks a required column (message names the file, row and keys).
        ValueError: ``chosen`` or ``rejected`` is neither a string nor chat messages ending with the
            assistant's answer, they are identical, or a source has no rows.
    """
    from .sources import iter_rows

    out: List[Dict[str, Any]] = []
    for _source, where, row in iter_rows(files, split):
        missing = [c for c in ("chosen", "rejected") if c not in row or row[c] is None]
        if missing or (row.get("prompt") is None and not isinstance(row.get("chosen"), (list, tuple))):
            raise KeyError(
                f"{where}missing preference column(s) {missing or ['prompt']}; found keys {sorted(row)}. "
                f"Preference data needs {list(REQUIRED_COLUMNS)} (chosen / rejected as text or as chat messages)."
            )
        row = _flatten_conversations(dict(row), where)
        if row["chosen"] == row["rejected"]:
            raise ValueError(f"{where}chosen and rejected are identical; a pair must differ.")
        p = row["prompt"]
        if isinstance(p, (list, tuple)):
            row["prompt"] = [{"role": m["role"], "content": m["content"]} for m in p]
        out.append(row)
        if max_samples is not None and len(out) >= max_samples:
            return out
    return out


def _flatten_conversations(row: Dict[str, Any], where: str) -> Dict[str, Any]:
    """chosen / rejected given as chat messages -> the text of their last (assistant) message; the prompt
    from the messages before it when the row has none."""
    for c in ("chosen", "rejected"):
        v = row[c]
        if hasattr(v, "tolist"):
            v = v.tolist()
        if isinstance(v, (list, tuple)):
            if not v or not all(isinstance(m, dict) and "content" in m for m in v) or v[-1].get("role") != "assistant":
                raise ValueError(f"{where}{c!r} as chat messages must end with an assistant message, got {v!r:.200}.")
            if row.get("prompt") is None:
                row["prompt"] = [{"role": m["role"], "content": m["content"]} for m in v[:-1]]
            v = v[-1]["content"]
        if not isinstance(v, str):
            raise ValueError(f"{where}{c!r} must be a string (or chat messages), got {type(v).__name__}.")
        row[c] = v
    if isinstance(row["prompt"], list) and not row["prompt"]:
        raise ValueError(f"{where}no prompt: the conversations hold only the answer and the row has no 'prompt'.")
    return row


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
