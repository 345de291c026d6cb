"""Reward-function registry keyed by ``data_source``, custom-function loading, and
fault-tolerant batch scoring.

Calling convention of a reward function
---------------------------------------
A reward fn is called with keyword arguments, and only with the ones it accepts (or all of
them if it takes ``**kwargs``) out of::

    data_source=..., solution_str=..., ground_truth=..., extra_info=...

so both ``rlhf.rewards.gsm8k.compute_score(solution_str, ground_truth, ...)`` and verl-style
custom functions ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
work unchanged. It must return a number (``bool``/``int``/``float``) or a dict with a
numeric ``"score"`` entry (verl convention); anything else counts as a failure.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .gsm8k import compute_score as gsm8k_compute_score
from .timeout import run_with_timeouts

__all__ = [
    "register_reward_fn",
    "register_reward_prefix",
    "refuse_data_source",
    "UnsupportedDataSourceError",
    "get_reward_fn",
    "registered_data_sources",
    "load_custom_reward_fn",
    "compute_scores",
    "call_reward_fn",
    "score_samples",
    "gsm8k_overrides",
    "ARITHMETIC_DATA_SOURCE",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]

# Kept in sync with rlhf.quickstart.arithmetic.DATA_SOURCE (not imported to keep this module light).
ARITHMETIC_DATA_SOURCE = "synthetic/arithmetic"

_REGISTRY: Dict[str, RewardFn] = {}
_PREFIXES: Dict[str, RewardFn] = {}  # data_source prefix -> fn (verl's data_source.startswith("aime"))
_REFUSED: Dict[str, str] = {}  # data_source -> why there is no rule reward for it
_CALL_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")


def register_reward_fn(*names: str, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward fn under one or more ``data_source`` names.

    Usage::

        @register_reward_fn("my/task", "my_task")
        def my_score(solution_str, ground_truth, extra_info=None) -> float: ...

    Also usable as a plain call: ``register_reward_fn("x")(fn)``.

    Raises:
        ValueError: no name given, or a name is already registered to a different function
            and ``overwrite`` is False.
        TypeError: a name is not a non-empty string, or the decorated object is not callable.
    """
    if not names:
        raise ValueError("register_reward_fn: give at least one data_source name, e.g. @register_reward_fn('my/task').")
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"register_reward_fn: data_source names must be non-empty strings, got {name!r}.")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward_fn({names!r}): {fn!r} is not callable.")
        for name in names:
            old = _REGISTRY.get(name)
            if old is not None and old is not fn and not overwrite:
                raise ValueError(
                    f"register_reward_fn: data_source {name!r} is already registered to {_fn_name(old)}; "
                    "pass overwrite=True to replace it."
                )
        for name in names:
            _REGISTRY[name] = fn
        return fn

    return decorator


class UnsupportedDataSourceError(KeyError):
    """A data_source refused with a reason (code needs a sandbox); a KeyError like an unknown data_source."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def register_reward_prefix(*prefixes: str, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Like :func:`register_reward_fn`, for every data_source starting with one of ``prefixes`` that has no
    exact registration (the longest prefix wins); e.g. ``register_reward_prefix("aime")`` for aime24, aime2025."""
    def decorator(fn: RewardFn) -> RewardFn:
        for p in prefixes:
            if not isinstance(p, str) or not p or (p in _PREFIXES and _PREFIXES[p] is not fn and not overwrite):
                raise ValueError(f"register_reward_prefix: {p!r} is empty or already registered; overwrite=True.")
        _PREFIXES.update({p: fn for p in prefixes})
        return fn
    return decorator


def refuse_data_source(*names: str, reason: str) -> None:
    """Make :func:`get_reward_fn` raise :class:`UnsupportedDataSourceError` with ``reason`` for ``names``."""
    _REFUSED.update({n: reason for n in names})


def registered_data_sources() -> List[str]:
    """Sorted list of registered ``data_source`` names; prefixes as ``"aime*"``."""
    return sorted(list(_REGISTRY) + [p + "*" for p in _PREFIXES])


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward fn registered for ``data_source`` (exactly, else by the longest registered prefix).

    Raises:
        UnsupportedDataSourceError: a refused data_source (:func:`refuse_data_source`) with no exact fn.
        KeyError: unknown ``data_source``; the message names it and lists the registered ones.
    """
    if isinstance(data_source, str):
        if data_source in _REGISTRY:
            return _REGISTRY[data_source]
        if data_source in _REFUSED:
            raise UnsupportedDataSourceError(f"data_source={data_source!r}: {_REFUSED[data_source]}")
        matches = [p for p in _PREFIXES if data_source.startswith(p)]
        if matches:
            return _PREFIXES[max(matches, key=len)]
    raise KeyError(
        f"No reward function registered for data_source={data_source!r}. Registered: "
        f"{registered_data_sources()}. Register one with @rlhf.rewards.register_reward_fn({data_source!r}) "
        "or pass a custom reward function (load_custom_reward_fn)."
    )


def _unregister(*names: str) -> None:
    """Remove names from the registry (for tests)."""
    for name in names:
        _REGISTRY.pop(name, None)
        _PREFIXES.pop(name, None)


def _fn_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --------------------------------------------------------------------------- built-ins


@register_reward_fn("openai/gsm8k", "gsm8k", ARITHMETIC_DATA_SOURCE)
def gsm8k_strict_reward(solution_str: str, ground_truth: Any) -> float:
    """GSM8K strict scorer: 1.0 if the first ``#### N`` equals the ground truth, else 0.0."""
    return gsm8k_compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)


GSM8K_DATA_SOURCES = ("openai/gsm8k", "gsm8k")


def gsm8k_overrides(method: str = "strict", format_score: float = 0.0) -> Dict[str, RewardFn]:
    """data_source -> GSM8K rule reward with config ``reward.gsm8k.{method,format_score}`` (strict: the number
    after the first ``####``; flexible: the last number); {} for the registry's default (strict, 0.0)."""
    method = str(getattr(method, "value", method))
    if (method, float(format_score)) == ("strict", 0.0):
        return {}

    def gsm8k_reward(solution_str: str, ground_truth: Any) -> float:
        return gsm8k_compute_score(solution_str, ground_truth, method=method, format_score=float(format_score))

    gsm8k_reward.__qualname__ = f"gsm8k_reward[{method}, format_score={format_score}]"
    return {ds: gsm8k_reward for ds in GSM8K_DATA_SOURCES}


# --------------------------------------------------------------------------- custom fn


def load_custom_reward_fn(path: str | os.PathLike, name: str = "compute_score") -> RewardFn:
    """Load the function ``name`` from the python file at ``path``.

    The file is executed as a fresh module (registered in ``sys.modules`` under a private
    name so pickling/dataclasses inside it work). Relative paths resolve against the CWD.

    ``object://reward/<n>`` is the in-process callable registered by rlhf.Trainer (rlhf.config.objects).

    Raises:
        FileNotFoundError: ``path`` does not exist (message names the resolved path).
        AttributeError: the file has no attribute ``name`` (message lists its public functions).
        TypeError: the attribute exists but is not callable.
        ImportError: the file failed to execute (the original error is chained).
        KeyError: an ``object://`` URI that is not registered in this process.
    """
    from rlhf.config.objects import get_object, is_object_ref

    if is_object_ref(path):
        return get_object(path)
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"load_custom_reward_fn: reward file {str(path)!r} not found (resolved to {str(p.resolve())!r}). "
            "Pass the path of a .py file defining the reward function."
        )
    mod_name = f"_rlhf_custom_reward_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, str(p))
    if spec is None or spec.loader is None:
        raise ImportError(f"load_custom_reward_fn: cannot import {str(p)!r} as a python module (is it a .py file?).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ImportError(f"load_custom_reward_fn: executing {str(p)!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        available = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_") and inspect.isfunction(v)
        )
        raise AttributeError(
            f"load_custom_reward_fn: {str(p)!r} has no function named {name!r}; functions defined there: {available}."
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"load_custom_reward_fn: {name!r} in {str(p)!r} is a {type(fn).__name__}, not a function.")
    return fn


# --------------------------------------------------------------------------- calling


_SIG_CACHE: Dict[int, Tuple[Any, Optional[frozenset]]] = {}


def _accepted_keys(fn: RewardFn) -> Optional[frozenset]:
    """Keyword names ``fn`` accepts among _CALL_KEYS; None means 'all' (**kwargs)."""
    cached = _SIG_CACHE.get(id(fn))
    if cached is not None and cached[0] is fn:
        return cached[1]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        keys: Optional[frozenset] = None
    else:
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            keys = None
        else:
            keys = frozenset(
                k
                for k in _CALL_KEYS
                if k in params
                and params[k].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            )
    _SIG_CACHE[id(fn)] = (fn, keys)
    return keys


def call_reward_fn(
    fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None
) -> float:
    """Call ``fn`` with the keyword arguments it accepts and coerce the result to float (:func:`reward_result`'s
    score)."""
    return reward_result(fn, data_source, solution_str, ground_truth, extra_info)[0]


def reward_result(
    fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None
) -> Tuple[float, Optional[dict]]:
    """(score, the fn's whole dict result or None) of one call: ``fn`` with the keyword arguments it accepts, its
    ``score`` (or plain number) coerced to float; the dict's other keys are verl's reward extra info (``acc`` of
    the DAPO math reward, ``pred``).

    Raises:
        TypeError: the fn returned something that is not a number or a dict with ``"score"`` (None included).
        ValueError: the fn returned NaN or +-inf (one such reward turns a whole group's advantages into NaN).
        Any exception raised by ``fn`` itself.
    """
    all_kwargs = dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
    keys = _accepted_keys(fn)
    kwargs = all_kwargs if keys is None else {k: v for k, v in all_kwargs.items() if k in keys}
    out = fn(**kwargs)
    info = out if isinstance(out, dict) else None
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"reward fn {_fn_name(fn)} returned a dict without a 'score' key: keys={sorted(out)}.")
        out = out["score"]
    if hasattr(out, "item") and callable(out.item):  # numpy / torch scalars
        out = out.item()
    if isinstance(out, bool) or isinstance(out, (int, float)):
        val = float(out)
    else:
        raise TypeError(f"reward fn {_fn_name(fn)} returned {type(out).__name__} {out!r}; expected a number.")
    if not math.isfinite(val):
        raise ValueError(f"reward fn {_fn_name(fn)} returned {val}; rewards must be finite.")
    return val, info


def compute_scores(
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Optional[Sequence[Optional[dict]]] = None,
    timeout_s: Optional[float] = None,
    fallback_score: float = 0.0,
    reward_fn: Optional[RewardFn] = None,
    max_workers: int = 8,
) -> Tuple[List[float], int]:
    """Score a batch of responses with the reward fn of each sample's ``data_source``.

    Args:
        data_sources: (B,) data_source per sample, looked up with :func:`get_reward_fn`
            (ignored for lookup when ``reward_fn`` is given, but still passed to it).
        responses: (B,) decoded responses.
        ground_truths: (B,) ground truths.
        extra_infos: optional (B,) dicts passed as ``extra_info``.
        timeout_s: per-sample time limit in seconds, measured from when the fn starts.
            ``None`` runs sequentially in the calling thread with no limit. With a limit,
            samples run on daemon worker threads and a fn still running after ``timeout_s``
            is abandoned (see :mod:`rlhf.rewards.timeout`).
        fallback_score: score given to a sample whose fn raised, timed out, or returned a
            non-number / NaN / +-inf.
        reward_fn: optional function used for every sample instead of the registry
            (e.g. from :func:`load_custom_reward_fn`).
        max_workers: number of worker threads when ``timeout_s`` is set.

    Returns:
        ``(scores, num_fallbacks)``: (B,) float scores and how many samples got
        ``fallback_score`` because of an error or timeout.

    Raises:
        ValueError: the sequences have different lengths, or ``timeout_s <= 0``.
        KeyError: a ``data_source`` has no registered reward fn (and no ``reward_fn`` given).
    """
    scores, failed = score_samples(data_sources, responses, ground_truths, extra_infos, timeout_s, reward_fn,
                                   max_workers)
    return [float(fallback_score) if f else s for s, f in zip(scores, failed)], sum(failed)


def score_samples(
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Optional[Sequence[Optional[dict]]] = None,
    timeout_s: Optional[float] = None,
    reward_fn: Optional[RewardFn] = None,
    max_workers: int = 8,
    overrides: Optional[Dict[str, RewardFn]] = None,
    reasons: Optional[List[str]] = None,
    extras: Optional[List[Optional[dict]]] = None,
) -> Tuple[List[float], List[bool]]:
    """:func:`compute_scores` without the fallback: ``(scores, failed)``, (B,) each; ``failed[i]`` when sample
    i's fn raised, timed out, or returned a non-number / NaN / +-inf (its score is then NaN).  `overrides`
    (data_source -> fn) take precedence over the registry.  With `reasons` (a list) every failure appends
    one short reason to it (``"TimeoutError (3s)"``, ``"ValueError: ..."``) and is logged at DEBUG only, for a
    caller that reports a summary (RewardManager: one warning per batch); without it each failure is a
    warning.  With `extras` (a list of B items) ``extras[i]`` becomes sample i's whole dict result (verl's reward
    extra info: ``acc``, ``pred``), None for a plain number or a failure.  Same arguments and errors as
    :func:`compute_scores`."""
    n = len(responses)
    if len(data_sources) != n or len(ground_truths) != n or (extra_infos is not None and len(extra_infos) != n):
        raise ValueError(
            "compute_scores: length mismatch: "
            f"data_sources={len(data_sources)}, responses={n}, ground_truths={len(ground_truths)}, "
            f"extra_infos={None if extra_infos is None else len(extra_infos)}; all must be equal."
        )
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"compute_scores: timeout_s={timeout_s!r} must be > 0 (or None for no limit).")
    overrides = overrides or {}
    fns = [reward_fn] * n if reward_fn is not None else [overrides.get(ds) or get_reward_fn(ds) for ds in data_sources]
    infos = list(extra_infos) if extra_infos is not None else [None] * n

    def run(i: int) -> float:
        score, info = reward_result(fns[i], data_sources[i], responses[i], ground_truths[i], infos[i])
        if extras is not None:
            extras[i] = info
        return score

    scores: List[float] = [math.nan] * n
    failed = [True] * n
    if n == 0:
        return scores, failed
    if timeout_s is None:
        for i in range(n):
            try:
                scores[i], failed[i] = run(i), False
            except Exception as e:  # noqa: BLE001
                _log_failure(i, data_sources[i], fns[i], e, reasons)
        return scores, failed

    results, timed_out = run_with_timeouts(run, n, float(timeout_s), max_workers)
    for i in range(n):
        if i in timed_out:
            if reasons is not None:
                reasons.append(f"{_fn_name(fns[i])} timed out ({timeout_s:.3g}s, reward.timeout_s)")
            (logger.debug if reasons is not None else logger.warning)(
                "reward fn %s timed out after %.3gs on sample %d (data_source=%r); using the fallback",
                _fn_name(fns[i]), timeout_s, i, data_sources[i],
            )
            continue
        ok, val = results[i]
        if ok:
            scores[i], failed[i] = val, False
        else:
            _log_failure(i, data_sources[i], fns[i], val, reasons)
    return scores, failed


def _log_failure(i: int, data_source: str, fn: RewardFn, err: BaseException, reasons: Optional[list] = None) -> None:
    if reasons is not None:
        reasons.append(f"{_fn_name(fn)}: {type(err).__name__}: {str(err)[:120]}")
    (logger.debug if reasons is not None else logger.warning)(
        "reward fn %s failed on sample %d (data_source=%r): %s: %s; using fallback score",
        _fn_name(fn), i, data_source, type(err).__name__, err,
    )
