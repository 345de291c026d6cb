"""``data.max_prompt_length`` and ``data.max_response_length`` against the data, before any model is built
(rlhf.preflight).

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

Responses: when the rows carry worked reference solutions (:func:`reference_solution`: GSM8K's ``answer``,
verl's GSM8K ``extra_info.answer``, a ``solution`` column), a warning (not an error: a policy may answer
more briefly than the references) when ``data.max_response_length`` is shorter than half of them -- responses
like them would be cut before their final answer and score 0 -- naming the length that fits 95% of them.
The engine's context (prompt + response) against the model's is checked in rlhf.config.validate.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from rlhf.data.refs import parse_data_ref, parse_model_ref

__all__ = ["length_report", "split_lengths", "SplitLengths", "reference_solution", "config_tokenizer", "MAX_ROWS"]

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


@dataclass
class SplitLengths:
    """Token counts of one split's first rows (:func:`split_lengths`)."""

    prompts: List[int] = field(default_factory=list)  # as RLHFDataset counts them
    references: List[int] = field(default_factory=list)  # reference solutions + EOS, as a response would count
    reference_key: Optional[str] = None  # the column of the first reference read
    more: bool = False  # rows were left unread (max_rows)


def reference_solution(row: dict) -> Optional[Tuple[str, str]]:
    """(column, text) of a row's reference solution, when the row has a worked one: ``solution`` (the MATH
    sets' and the quickstart's), GSM8K's ``answer`` (a worked solution ending in ``#### N``), or the copy
    verl's GSM8K parquet keeps in ``extra_info.answer``; None for rows with a bare answer only (verl's MATH /
    DAPO parquets: ``reward_model.ground_truth``)."""
    v = row.get("solution")
    if isinstance(v, str) and v.strip():
        return "solution", v
    v = row.get("answer")
    if isinstance(v, str) and "####" in v:
        return "answer", v
    extra = row.get("extra_info")
    v = extra.get("answer") if isinstance(extra, dict) else None
    if isinstance(v, str) and v.strip():
        return "extra_info.answer", v
    return None


def split_lengths(files: Any, tokenizer: Any, data_cfg: Any, split: str, max_rows: int = MAX_ROWS,
                  max_samples: Optional[int] = None) -> SplitLengths:
    """Token counts of the first `max_rows` rows of `files` (split "train" / "val"): the prompts as the
    trainer's dataset counts them, and the reference solutions (:func:`reference_solution`) with the EOS a
    response ends with.  Raises what reading a row raises (KeyError / TypeError / ValueError: a row without a
    usable prompt, a bad line, no rows), unless `max_samples` prompts that the dataset keeps
    (``data.max_train_samples`` / ``max_val_samples``: RLHFDataset stops reading once it holds that many) come
    before that row: then the counts stop there."""
    from omegaconf import OmegaConf

    from .prompts import normalize_row, render_prompt
    from .sources import iter_rows

    use_chat = data_cfg.apply_chat_template
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if use_chat is None else bool(use_chat)
    kwargs = data_cfg.chat_template_kwargs
    kwargs = (OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else kwargs) or None
    files = files if isinstance(files, str) else [str(f) for f in files]
    out = SplitLengths()
    texts: List[str] = []
    refs: List[str] = []
    eos = 1 if getattr(tokenizer, "eos_token_id", None) is not None else 0

    def flush() -> None:
        if texts:
            out.prompts.extend(len(ids) for ids in tokenizer(texts, add_special_tokens=not use_chat)["input_ids"])
        if refs:
            out.references.extend(len(ids) + eos for ids in tokenizer(refs, add_special_tokens=False)["input_ids"])
        texts.clear()
        refs.clear()

    limit = int(data_cfg.max_prompt_length) if data_cfg.filter_overlong_prompts else None
    rows = iter_rows(files, split)
    for n in itertools.count():
        if n >= max_rows:
            out.more = True
            break
        try:
            item = next(rows, None)
            if item is None:
                break
            _, where, row = item
            prompt = normalize_row(row, data_cfg.prompt_key, default_data_source="-", where=where)["prompt"]
        except (KeyError, TypeError, ValueError):
            flush()
            if max_samples is not None and sum(limit is None or x <= limit for x in out.prompts) >= max_samples:
                out.more = True  # the dataset has its prompts before this row and reads no further
                break
            raise
        texts.append(render_prompt(tokenizer, prompt, use_chat, kwargs))
        ref = reference_solution(row)
        if ref is not None:
            out.reference_key = out.reference_key or ref[0]
            refs.append(ref[1])
        if len(texts) >= 1024:
            flush()
    flush()
    return out


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


def _response_warning(key: str, files: Any, lengths: SplitLengths, limit: int, tok: str) -> Optional[str]:
    refs = sorted(lengths.references)
    if not refs or refs[len(refs) // 2] <= limit:
        return None  # no reference solutions, or at least half of them fit
    longer = sum(x > limit for x in refs)
    read = f"the first {len(refs)}" if lengths.more else f"the {len(refs)}"
    return (f"data.max_response_length={limit} is shorter than {longer} of {read} reference solutions of "
            f"{key}={files!r} ({100 * longer / len(refs):.0f}%; column {lengths.reference_key}: {refs[0]}..{refs[-1]}"
            f" tokens, median {refs[len(refs) // 2]}, with the tokenizer of {tok}): a response written like them is "
            f"cut before its final answer and scores 0; set data.max_response_length={_quantile(refs, 0.95)} to fit "
            f"95% of them ({refs[-1]}: all), keeping data.max_prompt_length + data.max_response_length within the "
            f"model's context.")


def _preference_problems(splits: List[Tuple[str, Any, str, Optional[int]]]) -> List[str]:
    """One problem per split the DPO trainer would stop on, read as it reads them (preference pairs: a prompt
    column, or chosen / rejected chat messages whose leading turns are the prompt; the first
    ``data.max_train_samples`` / ``max_val_samples`` of them): no rows, a missing column, identical chosen and
    rejected.  Its prompt lengths are not checked: it drops the pairs whose prompt is over
    data.max_prompt_length itself and names the setting when none is left."""
    from .preference import load_preference_dataset

    problems = []
    for key, files, split, max_samples in splits:
        rows = MAX_ROWS if max_samples is None else min(MAX_ROWS, int(max_samples))  # the trainer reads no more
        try:
            load_preference_dataset(files if isinstance(files, str) else [str(f) for f in files], rows, split)
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"{key}={files!r}: {e.args[0] if e.args else e}")
        except Exception as e:  # noqa: BLE001 - a file `datasets` cannot read: the DPO trainer reports it
            logger.debug("preference check of %s skipped: %s", key, e)
    return problems


def length_report(cfg: Any, hub_cached: Callable[[str], Any] = lambda name: None) -> Tuple[List[str], List[str]]:
    """(problems, warnings) of the module docstring, one line each, plus a problem for a split the dataset builder
    would stop on (no rows, a row without a usable prompt, a file whose reader raises KeyError/TypeError/ValueError,
    a bad JSON line included: its own message, naming the row or file).  With ``algorithm.name=dpo`` only
    the preference pairs' problems (:func:`_preference_problems`, read without a tokenizer).  Rows past what the
    builders read (``data.max_train_samples`` / ``max_val_samples``) are not checked.  Both [] when no split is a
    local file or a cached hub dataset, or (RL only) the tokenizer cannot be had cheaply; a split whose reading
    raises anything else is skipped (the dataset builder reports it).
    `hub_cached(name)`: the local cache of a hub dataset or None (rlhf.preflight.hub_cached_dataset;
    default: hub datasets are skipped)."""
    d = cfg.data
    splits = [(f"data.{k}", d[k], s, d[f"max_{s}_samples"]) for k, s in (("train_files", "train"), ("val_files", "val"))
              if _readable(d[k], hub_cached)]
    if not splits:
        return [], []
    if str(cfg.algorithm.name) == "dpo":
        return _preference_problems(splits), []
    try:
        tokenizer, tok = config_tokenizer(cfg)
    except Exception as e:  # noqa: BLE001 - the trainer reports a bad tokenizer itself
        logger.debug("length check skipped: %s", e)
        return [], []
    if tokenizer is None:
        return [], []
    problems, warnings = [], []
    prompts_checked = d.filter_overlong_prompts or str(d.truncation) == "error"  # else long prompts are cut
    for key, files, split, max_samples in splits:
        try:
            lengths = split_lengths(files, tokenizer, d, split, max_samples=max_samples)
        except (KeyError, TypeError, ValueError) as e:
            # an empty split or a row without a usable prompt: the dataset builder would stop on the same row
            # with the same message, after the engines and models were built
            problems.append(f"{key}={files!r}: {e.args[0] if e.args else e}")
            continue
        except Exception as e:  # noqa: BLE001 - a file `datasets` cannot read: the dataset builder reports it
            logger.debug("length check of %s skipped: %s", key, e)
            continue
        need = int(d.train_batch_size) if split == "train" else 1
        problem = _split_problem(key, files, lengths.prompts, lengths.more, d, need, tok) if prompts_checked else None
        warning = _response_warning(key, files, lengths, int(d.max_response_length), tok)
        problems += [problem] if problem else []
        warnings += [warning] if warning else []
    return problems, warnings
