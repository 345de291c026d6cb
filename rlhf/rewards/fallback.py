"""What a sample gets from a reward source that failed on it (error, timeout, None, NaN/+-inf): the
configured fallback (config ``reward.fallback``), the seed's graceful degradation.

    reward:
      fallback_score: 0.0
      fallback:
        type: rule            # rule | static | constant
        keywords: []          # static: words whose presence earns keyword_score
        keyword_score: 0.0
        length_penalty: 0.0   # static: per character past max_chars
        max_chars: null

* ``rule``: the registered rule reward of the sample's ``data_source`` (rlhf.rewards.registry; e.g. GSM8K
  answer matching when the reward model is down), under the same ``reward.timeout_s``.  Where that is
  not available (no rule for the data source, the failing source IS that rule, or the rule fails too)
  the static score below.
* ``static``: ``fallback_score + keyword_score * [any keyword in the response]
  - length_penalty * max(0, len(response) - max_chars)`` (characters; no penalty when max_chars is null).
* ``constant``: ``fallback_score``.

Only a rule fallback *scores* the sample: a sample that no source and no rule fallback could score is
unscorable (``RewardManager.score(..., return_valid=True)``), and the trainer leaves it out of its group's
baseline and of the loss when ``reward.exclude_unscorable`` (the static/constant value is then only
reported).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from .registry import get_reward_fn, score_samples

__all__ = ["FALLBACK_TYPES", "Fallback"]

FALLBACK_TYPES = ("rule", "static", "constant")


@dataclass
class Fallback:
    """The fallback of every source of a RewardManager (see the module docstring).

    Raises ValueError for an unknown type or a negative penalty / max_chars.
    """

    type: str = "constant"
    score: float = 0.0  # reward.fallback_score
    keywords: Sequence[str] = field(default_factory=list)
    keyword_score: float = 0.0
    length_penalty: float = 0.0
    max_chars: Optional[int] = None
    overrides: dict = field(default_factory=dict, compare=False)  # data_source -> rule fn (reward.gsm8k.*)

    def __post_init__(self):
        if self.type not in FALLBACK_TYPES:
            raise ValueError(f"reward.fallback.type={self.type!r}: use one of {list(FALLBACK_TYPES)}")
        if self.length_penalty < 0 or (self.max_chars is not None and self.max_chars < 0):
            raise ValueError(f"reward.fallback.length_penalty={self.length_penalty}, max_chars={self.max_chars}: "
                             "must be >= 0")
        self.keywords = [str(k) for k in self.keywords]

    @classmethod
    def from_config(cls, reward_cfg: Any, overrides: Optional[dict] = None) -> "Fallback":
        """From the config's ``reward`` section (``fallback_score`` and ``fallback.*``); `overrides`
        (data_source -> rule fn) as the rule source's."""
        f = reward_cfg.fallback
        return cls(f.type, float(reward_cfg.fallback_score), list(f.keywords), float(f.keyword_score),
                   float(f.length_penalty), f.max_chars, dict(overrides or {}))

    def static(self, response: str) -> float:
        """The static score of one response (module docstring), a finite float."""
        s = self.score
        if self.keywords and any(k in response for k in self.keywords):
            s += self.keyword_score
        if self.max_chars is not None:
            s -= self.length_penalty * max(0, len(response) - self.max_chars)
        return float(s)

    def scores(self, batch: dict, idx: Sequence[int], timeout_s: Optional[float], source_is_rule: bool
               ) -> Tuple[List[float], List[bool]]:
        """Fallback scores of samples `idx` of `batch` (the RewardManager's batch dict) for a failed source
        (`source_is_rule`: the failed source is the registry rule itself) -> (scores, scored): scored[j]
        when the rule fallback scored sample idx[j]."""
        if self.type == "constant":
            return [self.score] * len(idx), [False] * len(idx)
        out = [self.static(batch["responses"][i]) for i in idx]
        scored = [False] * len(idx)
        if self.type != "rule" or source_is_rule:
            return out, scored
        ruled = [j for j, i in enumerate(idx) if batch["data_sources"][i] in self.overrides
                 or _has_rule(batch["data_sources"][i])]
        if ruled:
            pick = [idx[j] for j in ruled]
            vals, failed = score_samples([batch["data_sources"][i] for i in pick],
                                         [batch["responses"][i] for i in pick],
                                         [batch["ground_truths"][i] for i in pick],
                                         [batch["extra_infos"][i] for i in pick], timeout_s=timeout_s,
                                         overrides=self.overrides, reasons=[])  # counted by the manager
            for j, v, f in zip(ruled, vals, failed):
                if not f and math.isfinite(v):
                    out[j], scored[j] = v, True
        return out, scored


def _has_rule(data_source: str) -> bool:
    try:
        get_reward_fn(data_source)
        return True
    except KeyError:
        return False
