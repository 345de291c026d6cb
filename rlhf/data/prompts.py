"""Prompt rows: normalize the accepted row schemas (project, verl, raw GSM8K) and render prompts to text."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import numpy as np

from . import gsm8k as _gsm8k

__all__ = ["normalize_row", "render_prompt"]


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
