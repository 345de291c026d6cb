"""Geometry3K rule reward (data source ``hiyouga/geometry3k``): answer accuracy plus a format bonus.

verl's ``verl/utils/reward_score/geo3k.py``: ``score = (1 - format_score) * acc + format_score * format`` with
``format_score = 0.1``, where

* ``format`` is 1.0 when the whole response matches ``<think>...</think> ... \\boxed{...} ...`` (the
  reasoning in think tags, then a boxed answer; verl's preprocessing asks for exactly that), else 0.0;
* ``acc`` is 1.0 when the content of the last ``\\boxed{}`` equals the ground truth.

So a response scores 1.0 (right and well formed), 0.9 (right, not in the format), 0.1 (wrong, in the format)
or 0.0.  verl grades ``acc`` with ``mathruler.grader.grade_answer`` (the PRM800K sympy grader); here it is
Hugging Face math-verify (:func:`rlhf.rewards.math_check.math_equal`, time-limited), as for MATH.
"""
from __future__ import annotations

import re
from typing import Any

from .math_answers import extract_boxed_answer, ground_truth_answer
from .math_check import math_equal
from .registry import register_reward_fn

__all__ = ["GEO3K_DATA_SOURCES", "format_reward", "acc_reward", "compute_score", "geo3k_reward"]

GEO3K_DATA_SOURCES = ("hiyouga/geometry3k",)

FORMAT_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(predict_str: str) -> float:
    """1.0 when the whole response matches ``<think>.*</think>.*\\boxed{.*}.*`` (newlines included), else 0.0."""
    return 1.0 if FORMAT_PATTERN.fullmatch(predict_str or "") else 0.0


def acc_reward(predict_str: str, ground_truth: Any, use_boxed: bool = True) -> float:
    """1.0 when the last ``\\boxed{}`` content (the whole response with ``use_boxed=False``) is equivalent to
    the ground truth under math-verify, else 0.0 (no boxed answer included)."""
    answer = extract_boxed_answer(predict_str) if use_boxed else (predict_str or "")
    if answer is None:
        return 0.0
    return 1.0 if math_equal(ground_truth_answer(ground_truth), answer) else 0.0


def compute_score(predict_str: str, ground_truth: Any, use_boxed: bool = True, format_score: float = 0.1) -> float:
    """Score a Geometry3K response (module doc); verl's signature.

    Args:
        predict_str: the decoded response.
        ground_truth: the reference answer, e.g. ``"2\\sqrt{221}"``.
        use_boxed: grade the last ``\\boxed{}`` content (True) or the whole response.
        format_score: the weight of the format term.

    Returns:
        ``(1 - format_score) * acc_reward + format_score * format_reward``, a float.
    """
    return (1.0 - format_score) * acc_reward(predict_str, ground_truth, use_boxed) + format_score * format_reward(
        predict_str)


@register_reward_fn(*GEO3K_DATA_SOURCES)
def geo3k_reward(solution_str: str, ground_truth: Any) -> float:
    """The registry's Geometry3K reward: :func:`compute_score` with verl's defaults (boxed, format_score 0.1)."""
    return compute_score(solution_str, ground_truth)
