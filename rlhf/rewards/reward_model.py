"""Interface for model-based rewards (a learned reward model, a judge LLM, ...).

Only the interface lives here; concrete scorers (e.g. a Megatron/HF sequence-classification
reward model) implement :class:`RewardModelScorer` elsewhere.
"""

from __future__ import annotations

import abc
import math
from typing import Any, List, Sequence, Union

__all__ = ["RewardModelScorer", "check_scores"]

# A prompt is either plain text or a chat-message list [{"role": ..., "content": ...}, ...].
Prompt = Union[str, List[dict]]


class RewardModelScorer(abc.ABC):
    """Scores (prompt, response) pairs with a model.

    Subclasses implement :meth:`score`. Any object with a compatible ``score`` method is
    also accepted by ``isinstance(obj, RewardModelScorer)`` (structural check), so callers
    can type-check duck-typed scorers.
    """

    @abc.abstractmethod
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> List[float]:
        """Return one float per pair.

        Args:
            prompts: (B,) prompts, as text or chat-message lists.
            responses: (B,) decoded responses.

        Returns:
            (B,) list of finite floats; higher is better.

        Raises:
            ValueError: ``len(prompts) != len(responses)``.
        """

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> List[float]:
        """Alias of :meth:`score` that validates lengths and the returned values."""
        if len(prompts) != len(responses):
            raise ValueError(
                f"{type(self).__name__}: got {len(prompts)} prompts but {len(responses)} responses; they must pair up."
            )
        return check_scores(self.score(prompts, responses), len(prompts), owner=type(self).__name__)

    @classmethod
    def __subclasshook__(cls, C: type) -> Any:
        if cls is RewardModelScorer:
            if any(callable(getattr(B, "__dict__", {}).get("score")) for B in C.__mro__):
                return True
        return NotImplemented


def check_scores(scores: Sequence[Any], expected_len: int, owner: str = "scorer") -> List[float]:
    """Validate a scorer's output: length ``expected_len``, all finite numbers.

    Returns:
        The scores as a list of Python floats.

    Raises:
        ValueError: wrong length or a non-finite value (message gives the index).
        TypeError: a value is not a number.
    """
    if len(scores) != expected_len:
        raise ValueError(f"{owner} returned {len(scores)} scores for {expected_len} samples.")
    out: List[float] = []
    for i, s in enumerate(scores):
        if hasattr(s, "item") and callable(s.item):
            s = s.item()
        if not isinstance(s, (int, float)):
            raise TypeError(f"{owner} returned {type(s).__name__} {s!r} at index {i}; expected a float.")
        f = float(s)
        if not math.isfinite(f):
            raise ValueError(f"{owner} returned non-finite score {f} at index {i}.")
        out.append(f)
    return out
