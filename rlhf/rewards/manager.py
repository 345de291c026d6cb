"""Reward sources combined with weights (config ``reward.sources``), each fault tolerant.

    reward:
      timeout_s: 3           # per sample for rule/custom sources, per micro batch for a model source
      fallback_score: 0.0    # see rlhf/rewards/fallback.py: what a source that failed on a sample gives it
      fallback: {type: rule} # rule (the data source's rule reward) | static (length/keyword score) | constant
      sources:
        - {type: rule, weight: 1.0}                          # rlhf.rewards registry, by data_source
        - {type: model, weight: 0.5, path: /models/rm-7b}    # HF sequence classifier (Ray worker)
        - {type: custom, weight: 1.0, path: my_reward.py, name: compute_score}

The score of a sample is ``sum_i weight_i * score_i``.  A source that raises, returns a non-number,
None, NaN or +-inf, or runs past ``timeout_s`` on a sample (a model source: on the micro batch of
``micro_batch_size`` pairs holding it) gives that sample the fallback instead, and training goes on;
every such sample is counted in ``reward/num_fallbacks`` and ``reward/<source>/num_fallbacks``, next
to each source's mean ``reward/<source>/mean`` (with several sources).  A sample that NO source and no
rule fallback could score is *unscorable*: counted in ``reward/num_unscorable`` and flagged in the
validity mask of ``score(..., return_valid=True)``, so the trainer can leave it out of the group
baseline and the loss (``reward.exclude_unscorable``).  With ``sources`` empty the reward is the rule
reward of each sample's data_source, or ``reward.custom_reward_function`` when that is set.  The GSM8K
rule (data sources openai/gsm8k, gsm8k) follows ``reward.gsm8k.{method,format_score}``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .fallback import Fallback
from .registry import gsm8k_overrides, load_custom_reward_fn, score_samples
from .sandbox_code import code_reward_overrides
from .reward_model import check_scores
from .timeout import call_with_timeout
from .validity import SAMPLE_ACC_KEY

__all__ = ["RewardSource", "RewardManager", "build_reward_manager", "check_reward_config", "load_custom_fn",
           "SOURCE_TYPES", "RewardSources", "build_reward_sources"]

logger = logging.getLogger(__name__)

SOURCE_TYPES = ("rule", "custom", "model")
PLACEMENTS = ("ray", "local")


@dataclass
class RewardSource:
    """One weighted source.  ``fn`` (rule/custom) scores one sample through the registry's calling
    convention; ``scorer`` (model) scores (prompt, response) pairs, ``chunk_size`` of them per call
    (None: the whole batch in one call), each call limited to the timeout."""

    name: str
    weight: float = 1.0
    fn: Optional[Callable] = None  # None with scorer None: registry lookup by data_source
    scorer: Any = None
    chunk_size: Optional[int] = None
    overrides: Optional[dict] = None  # rule: data_source -> fn before the registry (reward.gsm8k.*)
    start_timeout_s: Optional[float] = None  # model: seconds to wait for it to load (None: no limit)
    start_timeout_key: str = "reward.sources[i].start_timeout_s"  # the config key, for the error

    @property
    def is_rule(self) -> bool:
        """The registry's rule reward (no custom fn, no model)."""
        return self.fn is None and self.scorer is None

    def evaluate(self, batch: dict, timeout_s: Optional[float], reasons: Optional[List[str]] = None,
                 extras: Optional[list] = None) -> Tuple[List[float], List[bool]]:
        """-> (scores, failed) for `batch` (keys: responses, data_sources, ground_truths, extra_infos,
        prompts); a failed sample's score is NaN.  Never raises for a failing reward; config errors
        (unknown data_source) still raise.  With `reasons` (a list), one short reason per failed sample is
        appended to it and nothing is logged above DEBUG (the caller summarises); else each failure warns.  With
        `extras` (B items) a rule / custom fn's dict results are kept there (score_samples)."""
        n = len(batch["responses"])
        if self.scorer is None:
            return score_samples(batch["data_sources"], batch["responses"], batch["ground_truths"],
                                 extra_infos=batch["extra_infos"], timeout_s=timeout_s, reward_fn=self.fn,
                                 overrides=self.overrides, reasons=reasons, extras=extras)
        scores, failed = [math.nan] * n, [True] * n
        step = self.chunk_size or max(1, n)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            try:
                out = call_with_timeout(
                    lambda: self.scorer.score(batch["prompts"][lo:hi], batch["responses"][lo:hi]), timeout_s)
                scores[lo:hi], failed[lo:hi] = check_scores(out, hi - lo, owner=self.name), [False] * (hi - lo)
            except Exception as e:  # noqa: BLE001 - any failure of the model falls back
                why = (f"timed out ({timeout_s:.3g}s, reward.timeout_s)" if isinstance(e, TimeoutError)
                       or type(e).__name__ == "GetTimeoutError" else f"{type(e).__name__}: {str(e)[:120]}")
                if reasons is not None:
                    reasons += [f"{self.name} {why}"] * (hi - lo)
                (logger.debug if reasons is not None else logger.warning)(
                    "reward source %s failed on samples %d..%d: %s; using the fallback", self.name, lo, hi - 1, why)
        return scores, failed

    def wait_ready(self, timeout_s: Optional[float], key: str) -> None:
        """Block until the source can score: a reward model in its own Ray worker has loaded (it loads in
        the background from the moment it is built).  Nothing to wait for otherwise.

        Raises:
            TimeoutError: not ready after `timeout_s` seconds; the message names the config `key`.
            RuntimeError: the worker failed while loading (the message carries its error).
        """
        if self.scorer is not None and hasattr(self.scorer, "wait_ready"):
            self.scorer.wait_ready(timeout_s, key)

    def score(self, batch: dict, timeout_s: Optional[float], fallback_score: float) -> Tuple[List[float], int]:
        """-> (scores, num_fallbacks): :meth:`evaluate` with `fallback_score` for the failed samples."""
        scores, failed = self.evaluate(batch, timeout_s)
        return [float(fallback_score) if f else s for s, f in zip(scores, failed)], sum(failed)

    def close(self) -> None:
        """Release the reward model (its Ray worker), if any."""
        if self.scorer is not None and hasattr(self.scorer, "close"):
            self.scorer.close()


class RewardManager:
    """The reward of a batch: the weighted sum of several sources (verl's "reward manager").

    ``score(responses, data_sources, ground_truths, extra_infos=None, prompts=None, return_valid=False)``
    returns ``(scores, metrics)``, or ``(scores, metrics, valid)`` with ``return_valid=True``: one float per
    response; ``valid[i]`` is False for an unscorable sample (module docstring); metrics
    ``reward/num_fallbacks``, ``reward/num_unscorable``, ``reward/<source>/num_fallbacks`` and, with
    several sources, ``reward/<source>/mean``.  `fallback` (rlhf.rewards.fallback.Fallback) defaults to the
    constant ``fallback_score``.
    """

    def __init__(self, sources: Sequence[RewardSource], timeout_s: Optional[float] = None,
                 fallback_score: float = 0.0, fallback: Optional[Fallback] = None):
        if not sources:
            raise ValueError("RewardManager needs at least one source")
        self.sources = list(sources)
        self.timeout_s = timeout_s
        self.fallback = fallback or Fallback("constant", float(fallback_score))
        self.fallback_score = self.fallback.score

    def score(self, responses: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Optional[Sequence[Any]] = None, prompts: Optional[Sequence[Any]] = None,
              return_valid: bool = False, return_acc: bool = False):
        """Scores of one batch (lists of equal length B) -> ([B] floats, metrics); see the class docstring.

        With ``return_acc=True`` the metrics also carry under SAMPLE_ACC_KEY each sample's ``acc`` as verl's reward
        managers record it (verl/workers/reward_manager/dapo.py): the first rule / custom source's ``acc`` where its
        fn returns a dict holding one, else that source's score (after any fallback); with only reward models, the
        total.  DAPO's ``algorithm.filter_groups.metric=acc`` filters groups by it.

        With ``return_valid=True`` also a third item, [B] bools: False for a sample that NO source could
        score (every source fell back or gave a non-finite number; such a number is replaced by
        the reward.fallback value and counted as a fallback).  The trainer leaves those samples out of the group
        baselines and the loss (``reward.exclude_unscorable``, rlhf.trainer.advantages)."""
        n = len(responses)
        batch = {"responses": list(responses), "data_sources": list(data_sources),
                 "ground_truths": list(ground_truths),
                 "extra_infos": list(extra_infos) if extra_infos is not None else [None] * n,
                 "prompts": list(prompts) if prompts is not None else [""] * n}
        total, valid, acc = [0.0] * n, [False] * n, None
        metrics = {"reward/num_fallbacks": 0.0}
        summary = []
        for src in self.sources:
            reasons: List[str] = []
            extras: list = [None] * n
            scores, failed = src.evaluate(batch, self.timeout_s, reasons, extras=extras)
            idx = [i for i in range(n) if failed[i]]
            if idx:
                values, scored = self.fallback.scores(batch, idx, self.timeout_s, src.is_rule)
                for i, v, ok in zip(idx, values, scored):
                    scores[i], valid[i] = v, valid[i] or ok
                summary.append(_fallback_summary(src.name, len(idx), n, reasons, self.fallback.type, sum(scored)))
            valid = [v or not f for v, f in zip(valid, failed)]
            total = [t + src.weight * s for t, s in zip(total, scores)]
            if acc is None and src.scorer is None:  # verl: the score function's "acc", else its score
                acc = [float(x["acc"]) if isinstance(x, dict) and "acc" in x else float(s)
                       for x, s in zip(extras, scores)]
            metrics["reward/num_fallbacks"] += len(idx)
            metrics[f"reward/{src.name}/num_fallbacks"] = float(len(idx))
            if len(self.sources) > 1:
                metrics[f"reward/{src.name}/mean"] = sum(scores) / max(1, n)
        metrics["reward/num_unscorable"] = float(n - sum(valid))
        if return_acc:
            metrics[SAMPLE_ACC_KEY] = acc if acc is not None else list(total)
        if summary:  # one warning per batch, not one per sample
            logger.warning("reward fallbacks: %s (reward/num_fallbacks=%d, reward/num_unscorable=%d)",
                           "; ".join(summary), metrics["reward/num_fallbacks"], metrics["reward/num_unscorable"])
        return (total, metrics, valid) if return_valid else (total, metrics)

    def wait_ready(self) -> None:
        """Block until every source can score (:meth:`RewardSource.wait_ready`, each with its own
        ``start_timeout_s``); :func:`build_reward_manager` calls it so the first batch is never scored by
        fallbacks while a reward model is still loading."""
        for src in self.sources:
            src.wait_ready(src.start_timeout_s, src.start_timeout_key)

    def close(self) -> None:
        """Close every source."""
        for src in self.sources:
            src.close()


def load_custom_fn(path: str, name: str) -> Callable:
    """A custom source's function: an in-process callable (``object://reward/<id>``, rlhf.config.objects, from
    rlhf.Trainer) or function `name` of the python file `path` (:func:`load_custom_reward_fn`, same errors)."""
    from rlhf.config.objects import get_object, is_object_ref

    return get_object(path) if is_object_ref(path) else load_custom_reward_fn(path, name)


def check_reward_config(reward_cfg: Any) -> None:
    """Load every custom reward function of the config's ``reward`` section (a cheap import, on any rank)
    before models and engines are built.  Raises what :func:`load_custom_reward_fn` raises, naming the
    file: FileNotFoundError, ImportError (the file raised on import), AttributeError, TypeError."""
    crf = reward_cfg.custom_reward_function
    if not reward_cfg.sources and crf.path:
        load_custom_fn(crf.path, crf.name)
    for e in reward_cfg.sources or []:
        if e.type == "custom" and e.path:
            load_custom_fn(e.path, e.name)


def build_reward_manager(reward_cfg: Any) -> RewardManager:
    """`RewardManager` from the config's `reward` section (see the module docstring).

    Raises ValueError for an unknown type/placement or a model/custom source without `path`;
    FileNotFoundError / AttributeError for a custom file or function that does not exist.
    """
    entries = list(reward_cfg.sources or [])
    g = reward_cfg.get("gsm8k")
    rules = gsm8k_overrides(g.method, g.format_score) if g is not None else {}
    sf = reward_cfg.get("sandbox_fusion")
    if sf is not None and sf.url:  # code data sources run in a sandbox (verl's sandbox_fusion_url)
        rules = {**rules, **code_reward_overrides(sf.url, sf.max_concurrent, sf.memory_limit_mb)}
    fallback = Fallback.from_config(reward_cfg, rules)
    if not entries:
        crf = reward_cfg.custom_reward_function
        fn = load_custom_fn(crf.path, crf.name) if crf.path else None
        return RewardManager([RewardSource("custom" if fn else "rule", 1.0, fn=fn, overrides=rules)],
                             reward_cfg.timeout_s, fallback=fallback)
    sources, names = [], []
    for i, e in enumerate(entries):
        if e.type not in SOURCE_TYPES:
            raise ValueError(f"reward.sources[{i}].type={e.type!r}: use one of {list(SOURCE_TYPES)}")
        if e.type != "rule" and not e.path:
            raise ValueError(f"reward.sources[{i}] (type {e.type}) needs a path "
                             f"({'HF model directory or hub name' if e.type == 'model' else 'python file'})")
        name = e.type if sum(x.type == e.type for x in entries) == 1 else f"{e.type}{i}"
        names.append(name)
        if e.type == "rule":
            sources.append(RewardSource(name, float(e.weight), overrides=rules))
        elif e.type == "custom":
            sources.append(RewardSource(name, float(e.weight), fn=load_custom_fn(e.path, e.name)))
        else:
            if e.placement not in PLACEMENTS:
                raise ValueError(f"reward.sources[{i}].placement={e.placement!r}: use one of {list(PLACEMENTS)}")
            from .reward_model import HFRewardModelScorer, RayRewardModelScorer

            # on the CPU: a reward model on GPUs is neither placed nor planned (num_gpus > 0 is refused by the config)
            kw = dict(micro_batch_size=e.micro_batch_size, max_length=e.max_length, device="cpu")
            scorer = (RayRewardModelScorer(e.path, num_gpus=e.num_gpus, **kw) if e.placement == "ray"
                      else HFRewardModelScorer(e.path, **kw))
            sources.append(RewardSource(name, float(e.weight), scorer=scorer, chunk_size=e.micro_batch_size,
                                        start_timeout_s=e.start_timeout_s,
                                        start_timeout_key=f"reward.sources[{i}].start_timeout_s"))
    manager = RewardManager(sources, reward_cfg.timeout_s, fallback=fallback)
    manager.wait_ready()  # reward models load in their workers meanwhile; the first batch needs them
    return manager


def _fallback_summary(name: str, failed: int, n: int, reasons: Sequence[str], kind: str, scored: int) -> str:
    """``"model: 64/64 samples fell back (64 x model timed out (3s, reward.timeout_s)); rule fallback scored
    60"``: one source's failures in a batch, the reasons counted."""
    counts: dict = {}
    for r in reasons:
        counts[r] = counts.get(r, 0) + 1
    why = ", ".join(f"{c} x {r}" for r, c in sorted(counts.items(), key=lambda x: -x[1])[:3]) or "failed"
    tail = f"; rule fallback scored {scored}" if kind == "rule" else f"; {kind} fallback"
    return f"{name}: {failed}/{n} samples fell back ({why}){tail}"


# the names before the rename (tests, user code)
RewardSources = RewardManager
build_reward_sources = build_reward_manager
