"""Reward sources combined with weights (config ``reward.sources``), each fault tolerant.

    reward:
      timeout_s: 10          # per sample for rule/custom sources, per batch for a model source
      fallback_score: 0.0    # what a failed or timed-out source gives a sample
      sources:
        - {type: rule, weight: 1.0}                          # rlhf.rewards registry, by data_source
        - {type: model, weight: 0.5, path: /models/rm-7b}    # HF sequence classifier (Ray worker)
        - {type: custom, weight: 1.0, path: my_reward.py, name: compute_score}

The score of a sample is ``sum_i weight_i * score_i``.  A source that raises, returns a
non-number or runs past ``timeout_s`` gives ``fallback_score`` for the samples concerned
(a model source: for its whole batch) and training goes on; the count is reported as
``reward/num_fallbacks`` (all sources) and ``reward/<source>/num_fallbacks``, next to each
source's mean ``reward/<source>/mean``.  With ``sources`` empty the reward is the rule reward
of each sample's data_source, or ``reward.custom_reward_function`` when that is set.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .registry import compute_scores, load_custom_reward_fn
from .reward_model import check_scores
from .timeout import call_with_timeout

__all__ = ["RewardSource", "RewardManager", "build_reward_manager", "SOURCE_TYPES",
           "RewardSources", "build_reward_sources"]

logger = logging.getLogger(__name__)

SOURCE_TYPES = ("rule", "custom", "model")
PLACEMENTS = ("ray", "local")


@dataclass
class RewardSource:
    """One weighted source.  ``fn`` (rule/custom) scores one sample through the registry's calling
    convention; ``scorer`` (model) scores a whole batch of (prompt, response) pairs."""

    name: str
    weight: float = 1.0
    fn: Optional[Callable] = None  # None with scorer None: registry lookup by data_source
    scorer: Any = None

    def score(self, batch: dict, timeout_s: Optional[float], fallback_score: float) -> Tuple[List[float], int]:
        """-> (scores, num_fallbacks) for `batch` (keys: responses, data_sources, ground_truths,
        extra_infos, prompts).  Never raises for a failing reward; config errors (unknown
        data_source) still raise."""
        n = len(batch["responses"])
        if self.scorer is None:
            return compute_scores(batch["data_sources"], batch["responses"], batch["ground_truths"],
                                  extra_infos=batch["extra_infos"], timeout_s=timeout_s,
                                  fallback_score=fallback_score, reward_fn=self.fn)
        try:
            scores = call_with_timeout(lambda: self.scorer.score(batch["prompts"], batch["responses"]), timeout_s)
            return check_scores(scores, n, owner=self.name), 0
        except Exception as e:  # noqa: BLE001 - any failure of the model falls back
            logger.warning("reward source %s failed on a batch of %d: %s: %s; using fallback_score=%s",
                           self.name, n, type(e).__name__, e, fallback_score)
            return [float(fallback_score)] * n, n

    def close(self) -> None:
        """Release the reward model (its Ray worker), if any."""
        if self.scorer is not None and hasattr(self.scorer, "close"):
            self.scorer.close()


class RewardManager:
    """The reward of a batch: the weighted sum of several sources (verl's "reward manager").

    ``score(responses, data_sources, ground_truths, extra_infos=None, prompts=None)`` returns
    ``(scores, metrics)``: one float per response, and ``reward/num_fallbacks`` plus, with several
    sources, ``reward/<source>/mean`` and ``reward/<source>/num_fallbacks``.
    """

    def __init__(self, sources: Sequence[RewardSource], timeout_s: Optional[float] = None,
                 fallback_score: float = 0.0):
        if not sources:
            raise ValueError("RewardManager needs at least one source")
        self.sources = list(sources)
        self.timeout_s = timeout_s
        self.fallback_score = float(fallback_score)

    def score(self, responses: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Optional[Sequence[Any]] = None, prompts: Optional[Sequence[Any]] = None,
              return_valid: bool = False):
        """Scores of one batch (lists of equal length B) -> ([B] floats, metrics); see the class docstring.

        With ``return_valid=True`` also a third item, [B] bools: False for a sample that NO source could
        score (every source fell back or gave a non-finite number; such a number is replaced by
        fallback_score and counted as a fallback).  The trainer leaves those samples out of the group
        baselines and the loss (``reward.exclude_unscorable``, rlhf.trainer.advantages)."""
        n = len(responses)
        batch = {"responses": list(responses), "data_sources": list(data_sources),
                 "ground_truths": list(ground_truths),
                 "extra_infos": list(extra_infos) if extra_infos is not None else [None] * n,
                 "prompts": list(prompts) if prompts is not None else [""] * n}
        total = [0.0] * n
        metrics = {"reward/num_fallbacks": 0.0}
        valid = [False] * n
        for src in self.sources:
            # with return_valid, a NaN fallback marks the samples the source failed on (sources never return NaN)
            scores, fallbacks = src.score(batch, self.timeout_s, math.nan if return_valid else self.fallback_score)
            if return_valid:
                ok = [math.isfinite(s) for s in scores]
                fallbacks = ok.count(False)
                valid = [v or o for v, o in zip(valid, ok)]
                scores = [s if o else self.fallback_score for s, o in zip(scores, ok)]
            total = [t + src.weight * s for t, s in zip(total, scores)]
            metrics["reward/num_fallbacks"] += fallbacks
            if len(self.sources) > 1:
                metrics[f"reward/{src.name}/mean"] = sum(scores) / max(1, n)
                metrics[f"reward/{src.name}/num_fallbacks"] = float(fallbacks)
        return (total, metrics, valid) if return_valid else (total, metrics)

    def close(self) -> None:
        """Close every source."""
        for src in self.sources:
            src.close()


def build_reward_manager(reward_cfg: Any) -> RewardManager:
    """`RewardManager` from the config's `reward` section (see the module docstring).

    Raises ValueError for an unknown type/placement or a model/custom source without `path`;
    FileNotFoundError / AttributeError for a custom file or function that does not exist.
    """
    entries = list(reward_cfg.sources or [])
    if not entries:
        crf = reward_cfg.custom_reward_function
        fn = load_custom_reward_fn(crf.path, crf.name) if crf.path else None
        return RewardManager([RewardSource("custom" if fn else "rule", 1.0, fn=fn)], reward_cfg.timeout_s,
                             reward_cfg.fallback_score)
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
            sources.append(RewardSource(name, float(e.weight)))
        elif e.type == "custom":
            sources.append(RewardSource(name, float(e.weight), fn=load_custom_reward_fn(e.path, e.name)))
        else:
            if e.placement not in PLACEMENTS:
                raise ValueError(f"reward.sources[{i}].placement={e.placement!r}: use one of {list(PLACEMENTS)}")
            from .reward_model import HFRewardModelScorer, RayRewardModelScorer

            kw = dict(micro_batch_size=e.micro_batch_size, max_length=e.max_length)
            scorer = (RayRewardModelScorer(e.path, num_gpus=e.num_gpus, **kw) if e.placement == "ray"
                      else HFRewardModelScorer(e.path, **kw))
            sources.append(RewardSource(name, float(e.weight), scorer=scorer))
    return RewardManager(sources, reward_cfg.timeout_s, reward_cfg.fallback_score)


# the names before the rename (tests, user code)
RewardSources = RewardManager
build_reward_sources = build_reward_manager
