"""MATH rule reward (data sources ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
``HuggingFaceH4/MATH-500``): the last ``\\boxed{...}`` of the response, checked for equivalence with the
ground truth by Hugging Face math-verify (:func:`rlhf.rewards.math_check.math_equal`).

verl (``verl/utils/reward_score/__init__.py``, ``default_compute_score``) scores these data sources with
``math_reward.compute_score``: the last ``\\boxed`` answer, compared with the ground truth after the Hendrycks
MATH string normalization; its comment recommends math-verify (``math_verify.py``) for accuracy.  Here the
answer is taken as ``math_reward`` takes it and compared as math-verify compares, so ``0.5`` == ``\\frac12``,
``(1,2]`` == ``(1, 2]``, ``2\\sqrt{3}`` == ``\\sqrt{12}``, which the string normalization misses.  The return
value is verl's for these sources: a float, 1.0 when equivalent, 0.0 otherwise (no boxed answer included).

A boxed answer wholly wrapped in markdown emphasis (``\\boxed{**5**}``) is read without it
(:func:`rlhf.rewards.markdown.unwrap_emphasis`), as the plain ``\\boxed{5}`` would be; verl's normalization
keeps the ``*`` and scores it wrong.

The boxed-answer helpers here are shared by the other math families (geo3k, prime_math, dapo).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .markdown import unwrap_emphasis
from .math_check import math_equal
from .registry import register_reward_fn

__all__ = ["MATH_DATA_SOURCES", "last_boxed_only_string", "remove_boxed", "extract_boxed_answer",
           "ground_truth_answer", "compute_score"]

MATH_DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")

_BOXES = ("\\boxed{", "\\fbox{", "\\boxed ")


def last_boxed_only_string(text: str, boxes: Sequence[str] = _BOXES) -> Optional[str]:
    """The last boxed answer of ``text`` with its command: ``\\boxed{...}`` / ``\\fbox{...}`` with balanced
    braces, or the space form ``\\boxed 5`` (up to the next ``$`` or the end of the line).

    ``boxes``: the forms looked for (default all three).  Returns None when ``text`` has none, or its last
    one is never closed.
    (verl's ``last_boxed_only_string`` in ``math_reward.py`` prefers the space form whenever one appears
    anywhere; here the form that comes last wins.)
    """
    if not isinstance(text, str):
        return None
    starts = [(text.rfind(b), b) for b in boxes]
    idx, box = max(starts)
    if idx < 0:
        return None
    if box == "\\boxed ":
        rest = text[idx + len(box):]
        return box + rest.split("$")[0].split("\n")[0]
    depth = 0
    for i in range(idx + len(box) - 1, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[idx:i + 1]
    return None


def remove_boxed(boxed: Optional[str]) -> Optional[str]:
    """The content of ``\\boxed{X}`` / ``\\fbox{X}`` / ``\\boxed X`` (stripped); None for None or any other
    string."""
    if boxed is None:
        return None
    for box in _BOXES:
        if boxed.startswith(box):
            inner = boxed[len(box):]
            if box.endswith("{"):
                if not inner.endswith("}"):
                    return None
                inner = inner[:-1]
            return inner.strip()
    return None


def extract_boxed_answer(text: str) -> Optional[str]:
    """The content of the last boxed answer of ``text`` (:func:`last_boxed_only_string`), without markdown
    emphasis that wraps all of it (``\\boxed{**5**}`` -> ``5``), or None."""
    inner = remove_boxed(last_boxed_only_string(text))
    return None if inner is None else unwrap_emphasis(inner)


def ground_truth_answer(ground_truth: Any) -> str:
    """The reference answer: the string itself, or the last boxed answer when the ground truth is a whole
    solution (``... so the answer is \\boxed{5}``); a list / tuple holds the answer as its first item."""
    if isinstance(ground_truth, (list, tuple)) and ground_truth:
        ground_truth = ground_truth[0]
    gt = str(ground_truth).strip()
    boxed = extract_boxed_answer(gt) if "\\boxed" in gt or "\\fbox" in gt else None
    return boxed if boxed is not None else gt


@register_reward_fn(*MATH_DATA_SOURCES)
def compute_score(solution_str: str, ground_truth: Any) -> float:
    """Score a MATH response by its last boxed answer.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer (``"\\frac{1}{2}"``), or a solution ending in a boxed answer.

    Returns:
        1.0 when the content of the response's last ``\\boxed{}`` is equivalent to the reference under
        math-verify (:func:`rlhf.rewards.math_check.math_equal`, time-limited), else 0.0: no boxed answer,
        a different answer, or a check that ran out of time.  A float, as verl's ``default_compute_score``
        returns for these data sources.
    """
    answer = extract_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if math_equal(ground_truth_answer(ground_truth), answer) else 0.0
