"""Offline preference pairs for DPO.

Row schema: ``prompt`` (plain string or chat messages), ``chosen`` (str), ``rejected``
(str); other columns are kept as-is.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from .synthetic import DATA_SOURCE as ARITHMETIC_DATA_SOURCE
from .synthetic import make_arithmetic_dataset

__all__ = [
    "REQUIRED_COLUMNS",
    "load_preference_dataset",
    "make_synthetic_preference_dataset",
    "write_preference_parquet",
    "encode_preference_pair",
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
    from .rl_dataset import read_rows, resolve_data_files

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


def make_synthetic_preference_dataset(n: int, seed: int = 0, **arith_kwargs: Any) -> List[Dict[str, Any]]:
    """Preference pairs from the embedded arithmetic task.

    ``chosen`` is the correct worked solution; ``rejected`` is the same text with a wrong
    final number (the correct answer plus a non-zero offset in [-3, 3], kept >= 0), both
    in the ``... #### N`` format, so ``chosen`` scores 1 and ``rejected`` 0 under the strict
    GSM8K scorer.

    Args:
        n: number of pairs.
        seed: RNG seed (deterministic).
        arith_kwargs: forwarded to :func:`rlhf.data.synthetic.make_arithmetic_dataset`
            (``max_operand``, ``ops``, ``style``, ...).

    Returns:
        Rows with ``prompt`` (chat messages), ``chosen``, ``rejected``, ``ground_truth``,
        ``data_source`` ("synthetic/arithmetic"), ``extra_info``.
    """
    rows = make_arithmetic_dataset(n, seed=seed, **arith_kwargs)
    rng = random.Random(seed + 1_000_003)
    out = []
    for r in rows:
        ans = int(r["ground_truth"])
        offsets = [d for d in (-3, -2, -1, 1, 2, 3) if ans + d >= 0]
        wrong = ans + rng.choice(offsets)
        chosen = r["solution"]
        body = chosen.rsplit("#### ", 1)[0]
        body = body.replace(f"= {ans}", f"= {wrong}").replace(f"={ans}\n", f"={wrong}\n")
        rejected = f"{body}#### {wrong}"
        out.append({
            "prompt": r["prompt"],
            "chosen": chosen,
            "rejected": rejected,
            "ground_truth": r["ground_truth"],
            "data_source": ARITHMETIC_DATA_SOURCE,
            "extra_info": r["extra_info"],
        })
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
    from .rl_dataset import render_prompt

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
