"""PRIME / NuminaMath rule reward (data sources ``numina_aops_forum``, ``numina_synthetic_math``,
``numina_amc_aime``, ``numina_synthetic_amc``, ``numina_cn_k12``, ``numina_olympiads``).

verl's ``default_compute_score`` sends these to ``verl/utils/reward_score/prime_math/__init__.py``
(``compute_score`` -> ``match_answer``, then ``grade_answer`` / ``math_equal`` with sympy) and returns
``float(is_correct)``.  Here the answer is extracted with the same ``match_answer`` rules
(:func:`match_answer`) and compared by Hugging Face math-verify (:func:`rlhf.rewards.math_check.math_equal`,
time-limited) instead of PRIME's sympy grader.  Differences that follow from the checker: PRIME requires an
integer answer to match an integer ground truth as a string and an unreduced fraction to match exactly
(``2/4`` != ``1/2`` there, equal here), and tries pi = 3.14 for answers with ``\\pi``; math-verify does neither.
Markdown bold is read as spaces before the answer is looked for (:func:`rlhf.rewards.markdown.strip_bold`):
``Final Answer: **5**`` and ``The answer is **5**.`` score as the plain text does (PRIME reads ``**5**``).
"""
from __future__ import annotations

from typing import Any, Tuple

from .markdown import strip_bold
from .math_answers import ground_truth_answer
from .math_check import math_equal
from .registry import register_reward_fn

__all__ = ["PRIME_MATH_DATA_SOURCES", "match_answer", "compute_score"]

PRIME_MATH_DATA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                           "numina_cn_k12", "numina_olympiads")

_AFTER = ("answer:", "answer is", "answers are")  # the answer follows the last of these
_BEFORE = ("is answer", "is the answer", "are answers", "are the answers")  # ... or precedes it
_LEAD_INS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def _boxed_content(text: str) -> str:
    """The stripped content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (the braces after the command),
    or "" (PRIME's ``_last_boxed_only_string``)."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return ""
    depth, start = 0, None
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
            start = i if start is None else start
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i].strip()
    return ""


def match_answer(response: str) -> Tuple[bool, str]:
    """The answer of a PRIME-style response (verl ``prime_math.match_answer``'s rules).

    In order (after markdown bold delimiters became spaces, :func:`rlhf.rewards.markdown.strip_bold`): keep the
    text after the last ``answer:`` / ``answer is`` / ``answers are``; cut the text at
    the last ``is the answer`` (and the like); a ``\\boxed{}`` in what is left replaces it by its content;
    cut at the last ``". "``; keep what follows the last ``is ``, ``=``, ``: ``, ``be ``, ``get ``, ...

    Returns:
        ``(matched, answer)``: ``matched`` when a marker or a box was found and the answer has a digit.
    """
    text, matched = strip_bold(str(response)), False
    for marker in _AFTER:
        i = text.lower().rfind(marker)
        if i != -1:
            matched, text = True, text[i + len(marker):].strip()
    for marker in _BEFORE:
        i = text.lower().rfind(marker)
        if i != -1:
            matched, text = True, text[:i].strip()
    boxed = _boxed_content(text)
    if boxed:
        matched, text = True, boxed
    if ". " in text:
        text = text[:text.rfind(". ")].strip()
    for marker in _LEAD_INS:
        i = text.lower().rfind(marker)
        if i != -1:
            matched, text = True, text[i + len(marker):].strip()
    return matched and any(c.isdigit() for c in text), text


@register_reward_fn(*PRIME_MATH_DATA_SOURCES)
def compute_score(solution_str: str, ground_truth: Any) -> float:
    """Score a NuminaMath (PRIME) response.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer (a boxed solution is reduced to its last boxed answer).

    Returns:
        1.0 when the answer found by :func:`match_answer` is equivalent to the reference under math-verify,
        else 0.0 (a float, as verl's ``default_compute_score`` returns ``float(is_correct)`` here).
    """
    _, answer = match_answer(solution_str)
    return 1.0 if math_equal(ground_truth_answer(ground_truth), answer) else 0.0
