"""Rule-based GSM8K reward (verl-compatible signature).

``compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)``
returns ``score`` when the extracted answer equals the ground truth *as a number*,
``format_score`` when an answer in the expected format was found but is wrong, and
``0.0`` when no answer could be extracted.

Differences from verl's ``verl/utils/reward_score/gsm8k.py`` (deliberate):

* **No truncation.** verl only looks at the last 300 characters of the response. We
  search the whole text, so a long response whose answer line is followed by more than
  300 characters of continuation is still scored on its answer.
* **Strict mode takes the FIRST ``#### N``** (verl takes the last one). A policy that keeps
  generating past its answer (no EOS yet) often hallucinates a continuation such as a new
  question with its own ``#### M``; the first marker is the answer the model committed to.
  Markers that are not followed by a number (``#### the answer is 7``) are skipped.
* **Numeric comparison.** ``1,000`` == ``1000``, ``$18`` == ``18``, ``18.`` == ``18``,
  ``18.00`` == ``18``, ``-5`` / ``− 5`` are negatives. verl compares strings after
  stripping commas and ``$`` only, so ``18.00`` != ``18`` there.
* **Numbers glued to a preceding letter/digit/underscore are not numbers** (``mp3``,
  ``H2O``, ``abc123``). Trailing unit letters are allowed (``5kg`` -> 5).
* Comma grouping must be real thousands grouping (``1,234,567``); ``3,4`` is the two
  numbers 3 and 4 (verl would read ``34``).
* The marker may be followed by spaces/tabs (or none) on the same line: ``####72``,
  ``####  72`` and ``#### $72`` all read 72; ``####`` at the end of a line followed by a
  number on the next line does not count.
* **Markdown bold is not part of the answer** (:func:`rlhf.rewards.markdown.strip_bold`): ``#### **72**``,
  ``**#### 72**`` and ``The answer is __72__`` read 72 as the plain text would (verl reads no number after
  ``#### **`` and none glued to ``__``).
* Always returns a ``float``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional, Union

from .markdown import strip_bold

__all__ = ["compute_score", "extract_solution", "parse_number", "numbers_equal"]

_METHODS = ("strict", "flexible")

# Core of a number: thousands-grouped integer or plain digits, optional decimal part.
# The (?!\d) after the grouped alternative rejects things like "1,0000" as grouping.
_NUM_CORE = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
# Sign: ASCII hyphen-minus, unicode minus sign, en dash.
_SIGN = r"[-\u2212\u2013]"

# A free-standing number anywhere in the text (used by flexible mode and for parsing).
# It must not be glued to a preceding word character (letter / digit / underscore);
# a sign only counts as a sign if it is not itself glued to a preceding word character
# (so "3-5" reads 3 and 5, not 3 and -5).
_NUMBER_RE = re.compile(
    rf"(?:(?<![A-Za-z0-9_])(?P<neg>{_SIGN})\s?\$?\s?|(?<![A-Za-z0-9_])\$\s?(?P<neg2>{_SIGN})?\s?|(?<![A-Za-z0-9_]))"
    rf"(?P<num>{_NUM_CORE})"
)

# "####", optional whitespace, optional "$" / sign in either order, then the number.
_STRICT_RE = re.compile(
    rf"####[ \t]*(?:(?P<neg>{_SIGN})[ \t]?\$?[ \t]?|\$[ \t]?(?P<neg2>{_SIGN})?[ \t]?)?"
    rf"(?P<num>{_NUM_CORE})"
)


def _normalize(match: re.Match) -> str:
    neg = match.group("neg") or match.group("neg2")
    num = match.group("num").replace(",", "")
    return ("-" + num) if neg else num


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """Extract the final answer from a model response.

    Args:
        solution_str: the full decoded response (searched whole; no truncation; markdown bold delimiters
            ``**`` / ``__`` are read as spaces).
        method: ``"strict"``: the number right after the FIRST ``####`` marker that is
            followed by a number (whitespace, ``$`` and a sign allowed in between).
            ``"flexible"``: the LAST free-standing number anywhere in the text.

    Returns:
        The answer as a normalized numeric string (commas and ``$`` removed, sign
        kept, e.g. ``"-1000.50"``), or ``None`` if no answer was found.

    Raises:
        ValueError: if ``method`` is not ``"strict"`` or ``"flexible"``.
    """
    if method not in _METHODS:
        raise ValueError(f"extract_solution: method={method!r} is not supported; use one of {_METHODS}.")
    if solution_str is None:
        return None
    if not isinstance(solution_str, str):
        solution_str = str(solution_str)
    solution_str = strip_bold(solution_str)
    if method == "strict":
        m = _STRICT_RE.search(solution_str)
        return _normalize(m) if m else None
    last = None
    for last in _NUMBER_RE.finditer(solution_str):
        pass
    return _normalize(last) if last is not None else None


def parse_number(value: Union[str, int, float, Decimal]) -> Decimal:
    """Parse a ground-truth / extracted answer into a ``Decimal``.

    Accepts ints, floats, Decimals and strings like ``"1,000"``, ``"$18.00"``, ``"-5"``,
    ``"72."``, ``" 7 "`` and ``"#### 72"`` (the first ``####`` number is used).

    Raises:
        ValueError: if no number can be read from ``value``.
    """
    if isinstance(value, bool):
        raise ValueError(f"parse_number: expected a number, got bool {value!r}.")
    if isinstance(value, Decimal):
        return value
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        return Decimal(repr(value))
    text = str(value).strip()
    if "####" in text:
        extracted = extract_solution(text, "strict")
    else:
        m = _NUMBER_RE.fullmatch(text.rstrip("."))
        extracted = _normalize(m) if m else None
    if extracted is None:
        raise ValueError(
            f"parse_number: cannot read a number from {value!r}; GSM8K ground truths must be numbers "
            "like '72', '-5', '1,000' or '18.5'."
        )
    try:
        return Decimal(extracted)
    except InvalidOperation as e:  # pragma: no cover - regex guarantees a valid literal
        raise ValueError(f"parse_number: cannot read a number from {value!r}.") from e


def numbers_equal(a: Union[str, int, float, Decimal], b: Union[str, int, float, Decimal]) -> bool:
    """Whether two answers are the same number (``"18.00"`` == ``18`` == ``"$18"``).

    Raises:
        ValueError: if either side cannot be parsed (see :func:`parse_number`).
    """
    return parse_number(a) == parse_number(b)


def compute_score(
    solution_str: str,
    ground_truth: Union[str, int, float],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Score a GSM8K response against its ground-truth number.

    Strict mode reads the number after the FIRST ``#### `` marker (the model's committed
    answer; later ``####`` lines, e.g. from a hallucinated follow-up question, are ignored).
    Flexible mode reads the LAST number in the text. The whole response is searched (unlike
    verl, which truncates to the last 300 characters). Numbers compare numerically:
    ``1,000`` == ``1000``, ``$18.00`` == ``18``, ``18.`` == ``18``.

    Args:
        solution_str: decoded model response.
        ground_truth: the reference answer (e.g. ``"72"``, ``"1,000"``, ``72``).
        method: ``"strict"`` or ``"flexible"``.
        format_score: returned when an answer was extracted but is wrong.
        score: returned when the answer is correct.

    Returns:
        ``score`` if correct, ``format_score`` if an answer was found but is wrong,
        ``0.0`` if no answer was found.

    Raises:
        ValueError: unknown ``method``, or a ``ground_truth`` that is not a number.
    """
    answer = extract_solution(solution_str, method=method)
    truth = parse_number(ground_truth)
    if answer is None:
        return 0.0
    return float(score) if Decimal(answer) == truth else float(format_score)
