"""DAPO / AIME rule reward (data sources ``math_dapo``, ``math``, ``math_dapo_reasoning`` and every data source
starting with ``aime``): the last ``Answer: X`` line of the response, compared with the ground truth after
the Minerva answer normalization.

The rule is verl's ``verl/utils/reward_score/math_dapo.py`` (``compute_score`` -> ``verify`` ->
``is_correct_minerva``; the data sources are ``default_compute_score``'s), reimplemented here:

* the answer is the text after the LAST ``Answer:`` (any case, spaces around the colon allowed) up to the end
  of its line; no such line gives the prediction ``"[INVALID]"``;
* prediction and ground truth are normalized alike (:func:`normalize_final_answer`: the part after the
  last ``=``; spaces, units, ``\\text{}``, ``$`` and ``^\\circ`` removed; ``\\fracab`` -> ``\\frac{a}{b}``;
  ``1,000`` -> ``1000``) and compared as strings (no math equivalence: ``0.5`` != ``\\frac{1}{2}``);
* the result is verl's dict: ``{"score": 1.0 or -1.0, "acc": bool, "pred": normalized prediction}``.

``strict_box_verify=True`` is verl's other mode: the last ``\\boxed{}``, closed within the final 100 characters,
must equal the ground truth exactly.

Where this differs from verl (each time verl scores a right answer as wrong):

* **The whole response is read**, not its last 300 characters: ``Answer: 34`` followed by more than 300
  characters (a recheck, a summary, a continuation without EOS) is still read.  What verl's window protects is
  kept: the LAST ``Answer:`` of the response counts (an earlier one followed by a later one never does), and an
  answer line longer than :data:`MAX_ANSWER_CHARS` is no answer (verl could never read one whole, and the
  normalization's regular expressions take time quadratic in its length).
* **Markdown bold is not part of the answer** (rlhf.rewards.markdown): ``Answer: **34**``, ``**Answer:** 34``,
  ``**Answer**: 34`` and ``**Answer: 34**`` read ``34``, in the response and in the ground truth alike; in strict
  mode a boxed answer wrapped in emphasis (``\\boxed{**34**}``) is read without it.
* **Strict mode reads a long boxed answer whole**: verl looks for the box in the last 100 characters, so the
  ``\\boxed{`` of an answer over 92 characters falls outside and the answer is lost; here the box only has to
  END (close) within the final 100 characters, which keeps verl's "the box is at the end" rule.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional

from .markdown import strip_bold, unwrap_emphasis
from .math_answers import last_boxed_only_string
from .registry import register_reward_fn, register_reward_prefix

__all__ = ["DAPO_DATA_SOURCES", "DAPO_PREFIXES", "MAX_ANSWER_CHARS", "BOX_END_CHARS", "normalize_final_answer",
           "extract_answer_line", "last_box_at_end", "compute_score"]

DAPO_DATA_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DAPO_PREFIXES = ("aime",)

INVALID = "[INVALID]"
MAX_ANSWER_CHARS = 300  # verl's window: an answer line longer than this is no answer (the longest MATH-500 has 159)
# verl's answer pattern (?i)Answer\s*:\s*([^\n]+) as a lookahead: it matches at every place verl's would start, a
# second Answer: on the same line included; the line is read up to one character past MAX_ANSWER_CHARS
ANSWER_AT = re.compile(r"(?i)(?=Answer\s*:\s*([^\n]{1,%d}))" % (MAX_ANSWER_CHARS + 1))
BOX_END_CHARS = 100  # strict mode: the last box must close within the final 100 characters (verl's window)

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
    """The text after the last ``Answer:`` of ``solution_str`` up to the end of its line (verl's pattern
    ``(?i)Answer\\s*:\\s*([^\\n]+)``, at its last match), or ``"[INVALID]"`` when there is none or it is longer than
    :data:`MAX_ANSWER_CHARS` characters.  The whole response is read, markdown bold delimiters as spaces
    (:func:`rlhf.rewards.markdown.strip_bold`); "last" counts every ``Answer:``, also a second one on the line
    of another (verl's ``findall`` would take the line from the first).

    ``"Answer: 1\\nAnswer: **2**"`` -> ``" 2 "``; ``"answer: 3. Final Answer: 4"`` -> ``"4"``; ``"no answer"`` ->
    ``"[INVALID]"``.
    """
    last = None
    for last in ANSWER_AT.finditer(strip_bold(solution_str or "")):
        pass
    if last is None or len(last.group(1)) > MAX_ANSWER_CHARS:
        return INVALID
    return last.group(1)


def last_box_at_end(solution_str: str, end_chars: int = BOX_END_CHARS) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` of ``solution_str`` when that box closes within its final
    `end_chars` characters (emphasis wrapping the whole content removed: ``**34**`` -> ``34``), else None.

    verl's strict mode reads the last box of the final 100 characters, so an answer over 92 characters loses its
    ``\\boxed{``; a box that ends there is read whole here.  Whenever verl finds a box this finds the same one
    (the last ``\\boxed{`` of the text is the last of any suffix that holds one).
    """
    text = solution_str or ""
    boxed = last_boxed_only_string(text, boxes=("\\boxed{",))
    if boxed is None or text.rfind("\\boxed{") + len(boxed) <= len(text) - end_chars:
        return None
    return unwrap_emphasis(boxed[len("\\boxed{"):-1])


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False) -> Dict[str, Any]:
    """Score a DAPO-Math / AIME response by its last ``Answer:`` line (module doc).

    Args:
        solution_str: the decoded response (read whole; see the module doc for how this differs from verl).
        ground_truth: the reference answer, e.g. ``"34"`` (normalized like the prediction).
        strict_box_verify: verl's strict mode: the last ``\\boxed{}``, closed within the final 100 characters,
            must equal ``ground_truth`` exactly.

    Returns:
        ``{"score": 1.0, "acc": True, "pred": pred}`` when correct, ``{"score": -1.0, "acc": False,
        "pred": pred}`` otherwise; ``pred`` is the normalized prediction (``"[INVALID]"`` without an
        ``Answer:`` line; in strict mode the raw boxed content or None).  The registry takes ``"score"``.
    """
    if strict_box_verify:
        pred = last_box_at_end(solution_str)
        correct = pred == str(ground_truth)
    else:
        pred = normalize_final_answer(extract_answer_line(solution_str))
        correct = pred == normalize_final_answer(strip_bold(str(ground_truth)))
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}


@register_reward_fn(*DAPO_DATA_SOURCES)
def dapo_reward(solution_str: str, ground_truth: Any) -> Dict[str, Any]:
    """The registry's DAPO / AIME reward: :func:`compute_score` with verl's defaults (``Answer:`` format)."""
    return compute_score(solution_str, ground_truth)


register_reward_prefix(*DAPO_PREFIXES)(dapo_reward)
