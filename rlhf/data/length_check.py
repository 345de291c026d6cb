"""``data.max_prompt_length`` against the data, before any model is built (rlhf.config.preflight).

The prompts of ``data.train_files`` / ``data.val_files`` are rendered and tokenised exactly as
:class:`rlhf.data.rl_dataset.RLHFDataset` does (chat template or plain text, the model's tokenizer), the first
:data:`MAX_ROWS` rows of each split.  A problem is reported when the trainer would stop on them later:

* ``data.filter_overlong_prompts=true``: fewer prompts fit than one training batch (``data.train_batch_size``),
  or no validation prompt fits;
* ``data.filter_overlong_prompts=false`` with ``data.truncation=error``: any prompt is too long.

The message gives the fraction kept and the smallest ``data.max_prompt_length`` that keeps every prompt read
(and the one that keeps 95%).  Splits it cannot read cheaply are skipped (``embedded://`` tasks, which are
generated to fit; hub datasets not in the local cache; a tokenizer not on disk): the dataset builder still
checks them.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

from rlhf.config.refs import parse_data_ref, parse_model_ref

__all__ = ["prompt_length_problems", "prompt_lengths", "config_tokenizer", "MAX_ROWS"]

MAX_ROWS = 20000  # rows tokenised per split (GSM8K's 7473 train prompts: about a second)

logger = logging.getLogger(__name__)


def config_tokenizer(cfg: Any) -> Tuple[Any, str]:
    """(tokenizer, what it is) of the config, without building or downloading a model: ``model.tokenizer_path``
    (default ``model.path``) as an in-process object, a local directory, ``tiny://quickstart`` (its tokenizer,
    trained in memory) or a hub name already in the local cache; (None, why) when none can be had cheaply."""
    ref = cfg.model.tokenizer_path or cfg.model.path
    from rlhf.config.objects import get_object, is_object_ref

    if is_object_ref(ref):
        return get_object(ref), "model.tokenizer_path"
    parsed = parse_model_ref(ref)
    if parsed.kind == "tiny":
        from rlhf.quickstart.tokenizer import make_quickstart_tokenizer

        return make_quickstart_tokenizer(), str(ref)
    if parsed.kind not in ("local", "hub") or (parsed.kind == "local" and not parsed.exists):
        return None, f"{ref}: not a tokenizer on disk"
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(parsed.path, local_files_only=True), str(ref)
    except Exception as e:  # noqa: BLE001 - not in the cache: the trainer downloads it later
        return None, f"{ref}: {type(e).__name__}"


def _readable(files: Any, hub_cached: Callable[[str], Any]) -> bool:
    items = [files] if isinstance(files, str) else list(files or [])
    if not items:
        return False
    for item in items:
        ref = parse_data_ref(str(item))
        if ref.kind == "embedded" or ref.kind == "invalid" or (ref.kind == "local" and not ref.exists):
            return False
        if ref.kind == "hub" and hub_cached(ref.path) is None:
            return False
    return True


def prompt_lengths(files: Any, tokenizer: Any, data_cfg: Any, split: str, max_rows: int = MAX_ROWS
                   ) -> Tuple[List[int], bool]:
    """Token counts of the first `max_rows` prompts of `files` (split "train" / "val"), as the trainer's
    dataset counts them; and whether rows were left unread.  Raises what reading the rows raises."""
    from omegaconf import OmegaConf

    from .prompts import normalize_row, render_prompt
    from .sources import iter_rows

    use_chat = data_cfg.apply_chat_template
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if use_chat is None else bool(use_chat)
    kwargs = data_cfg.chat_template_kwargs
    kwargs = (OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else kwargs) or None
    files = files if isinstance(files, str) else [str(f) for f in files]
    lengths: List[int] = []
    texts: List[str] = []
    more = False

    def flush() -> None:
        lengths.extend(len(ids) for ids in tokenizer(texts, add_special_tokens=not use_chat)["input_ids"])
        texts.clear()

    for n, (_, where, row) in enumerate(iter_rows(files, split)):
        if n >= max_rows:
            more = True
            break
        prompt = normalize_row(row, data_cfg.prompt_key, default_data_source="-", where=where)["prompt"]
        texts.append(render_prompt(tokenizer, prompt, use_chat, kwargs))
        if len(texts) >= 1024:
            flush()
    flush()
    return lengths, more


def _quantile(sorted_lengths: List[int], q: float) -> int:
    return sorted_lengths[min(len(sorted_lengths) - 1, int(q * len(sorted_lengths)))]


def _split_problem(key: str, files: Any, lengths: List[int], more: bool, data_cfg: Any, need: int,
                   tok: str) -> Optional[str]:
    limit, n = int(data_cfg.max_prompt_length), len(lengths)
    kept = sum(x <= limit for x in lengths)
    error_mode = not data_cfg.filter_overlong_prompts and str(data_cfg.truncation) == "error"
    if not n or kept == n or (kept >= need if data_cfg.filter_overlong_prompts else not error_mode):
        return None  # every prompt fits, or enough do (a smaller data set is the dataset builder's to report)
    s = sorted(lengths)
    read = f"the first {n} prompts" if more else f"the {n} prompts"
    head = (f"data.max_prompt_length={limit} keeps {kept} of {read} of {key}={files!r} ({100 * kept / n:.0f}%)"
            if data_cfg.filter_overlong_prompts else
            f"data.max_prompt_length={limit} with data.truncation=error: {n - kept} of {read} of {key}={files!r} "
            f"are longer, and the trainer stops on the first")
    need_txt = f"; a training batch needs data.train_batch_size={need}" if key.endswith("train_files") and \
        data_cfg.filter_overlong_prompts else ""
    return (f"{head}{need_txt}: they have {s[0]}..{s[-1]} tokens with the tokenizer of {tok}; set "
            f"data.max_prompt_length={s[-1]} to keep them all ({_quantile(s, 0.95)} keeps 95%), keeping "
            f"data.max_prompt_length + data.max_response_length within the model's context.")


def prompt_length_problems(cfg: Any, hub_cached: Callable[[str], Any] = lambda name: None) -> List[str]:
    """The problems of the module docstring, one line each ([] when the data or tokenizer cannot be read
    cheaply, or reading them fails: the dataset builder reports that later with its own message).
    `hub_cached(name)`: the local cache of a hub dataset or None (rlhf.config.preflight.hub_cached_dataset;
    default: hub datasets are skipped)."""
    d = cfg.data
    if not d.filter_overlong_prompts and str(d.truncation) != "error":
        return []  # long prompts are truncated: nothing to stop on
    splits = [(f"data.{k}", d[k], s) for k, s in (("train_files", "train"), ("val_files", "val"))
              if _readable(d[k], hub_cached)]
    if not splits:
        return []
    try:
        tokenizer, tok = config_tokenizer(cfg)
    except Exception as e:  # noqa: BLE001 - the trainer reports a bad tokenizer itself
        logger.debug("prompt-length check skipped: %s", e)
        return []
    if tokenizer is None:
        return []
    out = []
    for key, files, split in splits:
        try:
            lengths, more = prompt_lengths(files, tokenizer, d, split)
        except Exception as e:  # noqa: BLE001 - bad rows: RLHFDataset names the row later
            logger.debug("prompt-length check of %s skipped: %s", key, e)
            continue
        need = int(d.train_batch_size) if split == "train" else 1
        problem = _split_problem(key, files, lengths, more, d, need, tok)
        if problem:
            out.append(problem)
    return out
