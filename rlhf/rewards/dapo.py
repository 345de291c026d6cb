"""DAPO / AIME rule reward (data sources ``math_dapo``, ``math``, ``math_dapo_reasoning`` and every data source
starting with ``aime``): the last ``Answer: X`` line of the response, compared with the ground truth after
the Minerva answer normalization.

The rule is verl's ``verl/utils/reward_score/math_dapo.py`` (``compute_score`` -> ``verify`` ->
``is_correct_minerva``; the data sources are ``default_compute_score``'s), reimplemented here:

* only the last 300 characters of the response are read;
* the answer is the text after the LAST ``Answer:`` (any case, spaces around the colon allowed) up to the end
  of its line; no such line gives the prediction ``"[INVALID]"``;
* prediction and ground truth are normalized alike (:func:`normalize_final_answer`: the part after the
  last ``=``; spaces, units, ``\\text{}``, ``$`` and ``^\\circ`` removed; ``\\fracab`` -> ``\\frac{a}{b}``;
  ``1,000`` -> ``1000``) and compared as strings (no math equivalence: ``0.5`` != ``\\frac{1}{2}``);
* the result is verl's dict: ``{"score": 1.0 or -1.0, "acc": bool, "pred": normalized prediction}``.

``strict_box_verify=True`` is verl's other mode: the last ``\\boxed{}`` in the final 100 characters must equal
the ground truth exactly.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from .math_answers import last_boxed_only_string
from .registry import register_reward_fn, register_reward_prefix

__all__ = ["DAPO_DATA_SOURCES", "DAPO_PREFIXES", "normalize_final_answer", "extract_answer_line", "compute_score"]

DAPO_DATA_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DAPO_PREFIXES = ("aime",)

ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

# Minerva's normalization (Lewkowycz et al. 2022, appendix D.1), in verl's order: (old, new) replacements,
# then words and commands that are dropped.
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
         "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
         "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
         "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
         ",\\!", "{,}", '"', "\\dots")
_REGEX_STEPS = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep only the first $...$
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
)


def normalize_final_answer(final_answer: str) -> str:
    """Minerva-normalize a final answer (verl ``math_dapo.normalize_final_answer``'s rules, see the module doc).

    Examples: ``"x = 5"`` -> ``"5"``; ``"10 \\text{ cm}"`` -> ``"10"``; ``"\\frac12"`` -> ``"\\frac{1}{2}"``;
    ``"1,000"`` -> ``"1000"``; ``"$42$"`` -> ``"42"``.
    """
    s = str(final_answer).split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for word in _DROP:
        s = s.replace(word, "")
    for pattern, repl in _REGEX_STEPS:
        s = pattern.sub(repl, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_answer_line(solution_str: str) -> str:
    """The text after the last ``Answer:`` of ``solution_str`` up to the end of its line, or ``"[INVALID]"``."""
    found = ANSWER_PATTERN.findall(solution_str or "")
    return found[-1] if found else INVALID


def _strict_box(tail: str, gt: str) -> Tuple[bool, Optional[str]]:
    boxed = last_boxed_only_string(tail[-100:], boxes=("\\boxed{",))
    pred = boxed[len("\\boxed{"):-1] if boxed is not None else None
    return pred == gt, pred


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False) -> Dict[str, Any]:
    """Score a DAPO-Math / AIME response by its last ``Answer:`` line (module doc).

    Args:
        solution_str: the decoded response (only its last 300 characters are read).
        ground_truth: the reference answer, e.g. ``"34"`` (normalized like the prediction).
        strict_box_verify: verl's strict mode: the last ``\\boxed{}`` of the final 100 characters must equal
            ``ground_truth`` exactly.

    Returns:
        ``{"score": 1.0, "acc": True, "pred": pred}`` when correct, ``{"score": -1.0, "acc": False,
        "pred": pred}`` otherwise; ``pred`` is the normalized prediction (``"[INVALID]"`` without an
        ``Answer:`` line; in strict mode the raw boxed content or None).  The registry takes ``"score"``.
    """
    tail = (solution_str or "")[-300:]
    if strict_box_verify:
        correct, pred = _strict_box(tail, str(ground_truth))
    else:
        pred = normalize_final_answer(extract_answer_line(tail))
        correct = pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}


@register_reward_fn(*DAPO_DATA_SOURCES)
def dapo_reward(solution_str: str, ground_truth: Any) -> Dict[str, Any]:
    """The registry's DAPO / AIME reward: :func:`compute_score` with verl's defaults (``Answer:`` format)."""
    return compute_score(solution_str, ground_truth)


register_reward_prefix(*DAPO_PREFIXES)(dapo_reward)
