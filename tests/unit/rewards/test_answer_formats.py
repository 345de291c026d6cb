"""Answers verl's rule scorers miss, scored here as the plain answer would be: markdown bold around an answer or
its marker (GSM8K strict and flexible, DAPO / AIME, MATH, NuminaMath), a DAPO ``Answer:`` followed by more than
300 characters (verl reads the last 300 only), a strict-box answer over 92 characters (verl reads the box in the
last 100 characters only), and verl's own PRIME test cases (a matrix written over several lines).  What verl's
windows protect stays: the last answer counts, an answer line over 300 characters is none, the strict box must
close at the end."""

import time

import pytest

from rlhf.rewards import get_reward_fn
from rlhf.rewards import registry as reg
from rlhf.rewards.dapo import compute_score as dapo_score
from rlhf.rewards.gsm8k import compute_score as gsm8k_score
from rlhf.rewards.markdown import strip_bold, unwrap_emphasis


def score(data_source, response, ground_truth):
    return reg.call_reward_fn(get_reward_fn(data_source), data_source, response, ground_truth)


# (data source, response with markdown, the same response in plain text); ground truth 73; the plain one scores
# right (1.0, or +1.0 for DAPO / AIME); before the fix the markdown one scored 0.0 / -1.0
BOLD = [
    ("openai/gsm8k", "48 + 25 = 73\n#### **73**", "48 + 25 = 73\n#### 73"),
    ("gsm8k", "#### __73__", "#### 73"),
    ("math_dapo", "Final Answer: **73**", "Final Answer: 73"),
    ("math_dapo", "Answer: **73**", "Answer: 73"),
    ("math_dapo", "**Answer:** 73", "Answer: 73"),
    ("math_dapo", "**Answer**: 73", "Answer: 73"),
    ("math_dapo", "**Answer: 73**", "Answer: 73"),
    ("aime24", "So we get 73.\n\n**Final Answer:** **73**", "So we get 73.\n\nFinal Answer: 73"),
    ("math", "Answer: __73__", "Answer: 73"),
    ("lighteval/MATH", "So the answer is $\\boxed{**73**}$.", "So the answer is $\\boxed{73}$."),
    ("HuggingFaceH4/MATH-500", "\\boxed{***73***}", "\\boxed{73}"),
    ("numina_olympiads", "Final Answer: **73**", "Final Answer: 73"),
    ("numina_cn_k12", "The final answer is **73**.", "The final answer is 73."),
    ("hiyouga/geometry3k", "<think>angles</think> \\boxed{*73*}", "<think>angles</think> \\boxed{73}"),
]


@pytest.mark.parametrize("data_source,bold,plain", BOLD)
def test_a_bold_answer_scores_as_the_plain_one(data_source, bold, plain):
    right = score(data_source, plain, "73")
    assert right == 1.0
    assert score(data_source, bold, "73") == right
    assert score(data_source, bold, "74") == score(data_source, plain, "74") < 1.0  # and a wrong one stays wrong


def test_gsm8k_flexible_reads_bold_numbers():
    assert gsm8k_score("Answer: __73__", "73", method="flexible") == 1.0  # verl: `_` glued -> no number
    assert gsm8k_score("so 5**2 = 25", "25", method="flexible") == 1.0  # `**` between numbers keeps them apart
    assert gsm8k_score("#### **72**\n#### 8", "72") == 1.0  # still the FIRST marker


def test_markdown_helpers():
    assert strip_bold("**Answer:** 73") == " Answer:  73"
    assert strip_bold("a*b and x_1 and f^{*}") == "a*b and x_1 and f^{*}"  # single * / _ are kept
    assert unwrap_emphasis("**73**") == "73" and unwrap_emphasis(" *73* ") == "73"
    assert unwrap_emphasis(" 34 ") == " 34 "  # nothing to unwrap: unchanged
    assert unwrap_emphasis("a*b") == "a*b" and unwrap_emphasis("f^{**}") == "f^{**}" and unwrap_emphasis("**") == "**"


# ----------------------------------------------------------------------------- DAPO: the whole response

TAIL = "\n" + "Let me double-check: 17 + 17 = 34, and 34 is even, as required. " * 6  # 391 characters


def test_dapo_answer_followed_by_more_than_300_characters_is_read():
    assert len(TAIL) > 300
    response = "17 + 17 = 34.\nAnswer: 34" + TAIL
    assert dapo_score(response, "34") == {"score": 1.0, "acc": True, "pred": "34"}  # verl: -1.0, "[INVALID]"
    for ds in ("math_dapo", "aime2024", "math"):
        assert score(ds, response, "34") == 1.0


def test_dapo_keeps_what_the_300_character_window_protected():
    # the LAST answer counts, wherever it is
    assert dapo_score("Answer: 34" + TAIL + "\nAnswer: 35", "34")["pred"] == "35"
    assert dapo_score("Answer: 35" + TAIL + "\n**Answer:** 34", "34")["acc"] is True
    assert dapo_score("I guess answer: 33. Final Answer: 34", "34")["pred"] == "34"  # two on one line: the last
    assert dapo_score("Answer: 34\nAnswer:", "34")["pred"] == "34"  # an empty marker is none (verl's pattern)
    # an answer line longer than 300 characters is no answer (verl never reads one whole)
    assert dapo_score("Answer: 34" + " filler" * 100, "34")["pred"] == "[INVALID]"
    # and a long response, even one huge line, is scored at once (the normalization is quadratic in its input)
    for response in ("Answer: " + "9" * 200_000, "answer: " * 25_000, "x" * 200_000 + "\nAnswer: 34"):
        t0 = time.monotonic()
        dapo_score(response, "34")
        assert time.monotonic() - t0 < 1.0


# ----------------------------------------------------------------------------- DAPO strict box: long answers

LONG = "\\left(" + ", ".join(f"\\frac{{{i}}}{{{i + 1}}}" for i in range(1, 11)) + "\\right)"  # 157 characters


def test_strict_box_reads_a_long_boxed_answer_whole():
    assert len(LONG) > 92
    response = f"Collecting the terms, the tuple is $\\boxed{{{LONG}}}$."
    assert dapo_score(response, LONG, strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": LONG}
    assert dapo_score(response, "(1)", strict_box_verify=True)["score"] == -1.0


def test_strict_box_must_still_close_at_the_end():
    box = "\\boxed{12}"
    assert dapo_score(box + "x" * 99, "12", strict_box_verify=True)["pred"] == "12"  # closes in the last 100
    assert dapo_score(box + "x" * 100, "12", strict_box_verify=True)["pred"] is None  # closes before them
    assert dapo_score(f"\\boxed{{{LONG}}}" + " " * 100, LONG, strict_box_verify=True)["pred"] is None
    assert dapo_score("\\boxed{**12**}", "12", strict_box_verify=True)["acc"] is True


# ----------------------------------------------------------------------------- verl's own test cases

# verl tests/utils/reward_score/test_sandbox_on_cpu.py: prime_math_answers / prime_math_gts, all scored 1.0 by
# default_compute_score("numina_aops_forum", ...); the matrix written over several lines scored 0.0 here before
VERL_PRIME = [
    ("\\begin{bmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19 \n \\end{bmatrix}",
     "\\begin{pmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19\n \\end{pmatrix}"),
    ("\\frac{\\sqrt{505}}{7}", "\\frac{\\sqrt{505}}{7}"),
    ("x^2 + y^2 + 4x - 6y + 13", "(x + 2)^2 + (y - 3)^2 "),
]


@pytest.mark.parametrize("completion,ground_truth", VERL_PRIME, ids=["matrix", "frac", "symbolic"])
def test_verl_prime_math_cases(completion, ground_truth):
    assert score("numina_aops_forum", completion, ground_truth) == 1.0
