"""Search-R1 style QA reward: exact match of the last ``<answer>...</answer>`` after SQuAD normalization.

Data sources: verl's ``searchR1_nq``, ``searchR1_triviaqa``, ``searchR1_popqa``, ``searchR1_hotpotqa``,
``searchR1_2wikimultihopqa``, ``searchR1_musique``, ``searchR1_bamboogle`` (``default_compute_score``; verl's
``examples/data_preprocess/preprocess_search_r1_dataset.py`` prefixes the Search-R1 names with ``searchR1_``)
and the un-prefixed Search-R1 names ``nq``, ``triviaqa``, ``popqa``, ``hotpotqa``, ``2wikimultihopqa``,
``musique``, ``bamboogle`` (the Search-R1 data sets as published; verl has no entry for them).

The rule is verl's ``verl/utils/reward_score/search_r1_like_qa_em.py`` ``compute_score``:

* the answer is the content of the LAST ``<answer>...</answer>`` (newlines allowed inside), stripped; none
  gives 0.0;
* answer and golden answers are normalized: lower case, punctuation removed, the articles a / an / the
  removed, whitespace collapsed; the answer is correct when it equals any golden answer;
* correct: ``score`` (1.0), or ``score / 4`` when the response has more than 10 ``<answer>`` or more than 10
  ``</answer>`` tags (answer spamming); wrong: ``format_score`` (0.0).

The ground truth is verl's ``{"target": [answers...]}`` (a list, tuple, numpy array or one string); a bare
list or string is accepted too.  verl also prints one sample in 64 to stdout; this does not.
"""
from __future__ import annotations

import re
import string
from typing import Any, List, Optional

from .registry import register_reward_fn

__all__ = ["QA_DATA_SOURCES", "normalize_answer", "extract_solution", "golden_answers", "em_check",
           "subem_check", "compute_score", "compute_score_subem"]

_SEARCH_R1_SETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
QA_DATA_SOURCES = tuple(f"searchR1_{n}" for n in _SEARCH_R1_SETS) + _SEARCH_R1_SETS

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower case, ASCII punctuation removed, articles removed, whitespace collapsed."""
    s = str(s).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def extract_solution(solution_str: str) -> Optional[str]:
    """The stripped content of the last ``<answer>...</answer>`` of the response, or None."""
    found = _ANSWER.findall(solution_str or "")
    return found[-1].strip() if found else None


def golden_answers(ground_truth: Any) -> List[str]:
    """The golden answers of a ground truth: ``{"target": ...}`` or the answers themselves (string / list)."""
    target = ground_truth.get("target", []) if isinstance(ground_truth, dict) else ground_truth
    if target is None:
        return []
    if isinstance(target, str):
        return [target]
    if hasattr(target, "tolist"):  # numpy array from parquet
        target = target.tolist()
    return [str(t) for t in (target if isinstance(target, (list, tuple)) else [target])]


def em_check(prediction: str, answers: Any) -> bool:
    """Whether the normalized prediction equals any normalized golden answer."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(a) == pred for a in golden_answers(answers))


def subem_check(prediction: str, answers: Any) -> bool:
    """Whether any normalized golden answer is a substring of the normalized prediction."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(a) in pred for a in golden_answers(answers))


def _score(solution_str: str, ground_truth: Any, check, format_score: float, score: float,
           spam_penalty: bool) -> float:
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    if not check(answer, ground_truth):
        return float(format_score)
    if spam_penalty and (solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10):
        return float(score) / 4
    return float(score)


@register_reward_fn(*QA_DATA_SOURCES)
def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """Exact-match QA reward (module doc).

    Args:
        solution_str: the decoded response.
        ground_truth: ``{"target": [answers]}``, a list of answers or one answer.
        method: unused (verl's signature).
        format_score: the score of an extracted answer that is wrong.
        score: the score of a correct answer.

    Returns:
        0.0 without ``<answer>``; ``score`` (``score / 4`` with more than 10 answer tags) when correct;
        ``format_score`` otherwise.  A float.
    """
    return _score(solution_str, ground_truth, em_check, format_score, score, spam_penalty=True)


def compute_score_subem(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                        score: float = 1.0) -> float:
    """verl's substring variant: correct when a golden answer occurs in the normalized answer (no tag
    penalty); same arguments and returns as :func:`compute_score`.  Not registered for any data source."""
    return _score(solution_str, ground_truth, subem_check, format_score, score, spam_penalty=False)
