"""Markdown emphasis around answers: ``Final Answer: **73**``, ``**Answer:** 73``, ``#### __73__``,
``\\boxed{**73**}``.  Chat models write these; verl's rule scorers read the delimiters as part of the answer (or
miss the ``Answer:`` marker), so a right answer in bold scores as a wrong one.  The rule scorers here remove the
delimiters first, so a bold answer scores as the plain one would.

* :func:`strip_bold`: every run of two or three ``*`` or ``_`` (markdown bold, bold italic) becomes a space, in
  the whole text.  Such runs do not occur in LaTeX or in plain numbers, and a space keeps numbers on either side
  apart (``5**2`` -> ``5 2``, not ``52``).
* :func:`unwrap_emphasis`: an answer that is wholly wrapped in one delimiter run (``**73**``, ``*73*``,
  ``__73__``) loses it; nothing inside is touched (so ``f^{**}`` or ``a*b`` stay).
"""
from __future__ import annotations

import re

__all__ = ["strip_bold", "unwrap_emphasis"]

_BOLD_RUN = re.compile(r"\*{2,3}|_{2,3}")
_WRAPPED = re.compile(r"(\*{1,3}|_{1,3})(.+)\1", re.DOTALL)


def strip_bold(text: str) -> str:
    """`text` with every run of 2-3 ``*`` / ``_`` (markdown bold) replaced by one space.

    ``"**Answer:** 73"`` -> ``" Answer:  73"``; ``"#### **73**"`` -> ``"####  73 "``; text without such runs is
    returned unchanged.
    """
    return _BOLD_RUN.sub(" ", text) if ("**" in text or "__" in text) else text


def unwrap_emphasis(answer: str) -> str:
    """`answer` without markdown emphasis that wraps all of it (``**73**``, ``*73*``, ``__73__``, ``***73***``;
    surrounding spaces ignored), repeatedly; any other answer is returned unchanged (spaces included)."""
    out = answer
    while True:
        m = _WRAPPED.fullmatch(out.strip())
        if m is None or not m.group(2).strip():
            return out
        out = m.group(2).strip()
