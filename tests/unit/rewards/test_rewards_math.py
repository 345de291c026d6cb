"""verl's rule rewards by data_source: MATH (last \\boxed{}, math-verify), DAPO / AIME ("Answer:" line), NuminaMath
(PRIME answer matching), Geometry3K (accuracy + format), Search-R1 QA (exact match), the time limit on
pathological answers, and the refusal of code data sources."""

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rlhf.rewards import (  # noqa: E402
    RewardManager,
    RewardSource,
    UnsupportedDataSourceError,
    compute_scores,
    get_reward_fn,
    math_equal,
    register_reward_fn,
    registered_data_sources,
)
from rlhf.rewards import registry as reg  # noqa: E402
from rlhf.rewards.code_sources import CODE_DATA_SOURCES  # noqa: E402
from rlhf.rewards.dapo import compute_score as dapo_score, normalize_final_answer  # noqa: E402
from rlhf.rewards.math_answers import MATH_DATA_SOURCES, extract_boxed_answer, last_boxed_only_string  # noqa: E402
from rlhf.rewards.math_check import MathCheckPool  # noqa: E402
from rlhf.rewards.prime_math import match_answer  # noqa: E402
from rlhf.rewards.qa import compute_score_subem  # noqa: E402


def score(data_source, response, ground_truth, extra_info=None):
    return reg.call_reward_fn(get_reward_fn(data_source), data_source, response, ground_truth, extra_info)


# (ground truth, boxed answer of the response, equivalent?)
MATH_PAIRS = [
    # fractions vs decimals, \dfrac / \tfrac, shorthand
    (r"\frac{1}{2}", "0.5", True),
    (r"\frac{1}{2}", r"\dfrac{1}{2}", True),
    (r"\frac{1}{2}", r"\tfrac12", True),
    (r"\frac{1}{2}", "1/2", True),
    (r"\frac12", r"\frac{1}{2}", True),
    (r"\frac{3}{4}", "0.75", True),
    (r"\frac{7}{2}", "3.5", True),
    (r"3\frac{1}{2}", "3.5", True),  # mixed number
    (r"\frac{1}{3}", "0.33", False),  # too coarse
    (r"\frac{1}{2}", r"\frac{1}{3}", False),
    # intervals
    ("(1, 2]", "(1,2]", True),
    ("(1,2]", "[1,2]", False),
    (r"[2, \infty)", r"[2,\infty)", True),
    (r"(-\infty, 3)", r"(-\infty, 3]", False),
    (r"(-\infty,-2)\cup(2,\infty)", r"(-\infty, -2) \cup (2, \infty)", True),
    (r"(-\infty,-2)\cup(2,\infty)", r"(-\infty, 2) \cup (2, \infty)", False),
    (r"x \in [1, 2]", "[1,2]", True),
    # units
    ("10", r"10 \text{ cm}", True),
    (r"10 \text{ cm}", "10", True),
    ("6", r"6\text{ inches}", True),
    ("10", r"11 \text{ cm}", False),
    # degrees
    (r"30^\circ", "30", True),
    ("30", r"30^{\circ}", True),
    ("45", r"30^\circ", False),
    # percent (dropped, as verl's MATH normalization does)
    (r"50\%", "50", True),
    ("50", r"50\%", True),
    (r"50\%", "0.5", False),
    # sets and tuples
    (r"\{1, 2\}", r"\{2, 1\}", True),
    (r"\{1,2,3\}", r"\{1,2\}", False),
    ("(1, 2)", "(2, 1)", False),
    ("(1,2)", r"\left( 1, 2 \right)", True),
    ("(3, -4)", "(3,-4)", True),
    ("2, -3", "-3, 2", True),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}", False),
    # square roots
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", True),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    (r"2\sqrt{3}", r"\sqrt{12}", True),
    (r"5\sqrt{2}", r"\sqrt{50}", True),
    (r"\sqrt{2}", r"\sqrt2", True),
    (r"\sqrt{3}", r"\sqrt{2}", False),
    (r"\sqrt{2}", "1.414", False),
    # negative numbers
    ("-3", "3", False),
    ("-7", "-7", True),
    (r"-\frac{1}{2}", "-0.5", True),
    (r"-\frac{1}{2}", r"\frac{-1}{2}", True),
    (r"\frac{1}{2}", r"-\frac{1}{2}", False),
    ("-2", "-2.0", True),
    # LaTeX spacing and number formatting
    (r"\frac{1}{2}", r"\frac {1} {2}", True),
    ("5", "- 5", False),
    ("1000", "1,000", True),
    ("1000", r"1{,}000", True),
    ("1000", r"1\,000", True),  # thin space inside a number
    (r"1\,000", "0", False),
    ("12", "12.0", True),
    ("12", "12.01", False),
    (r"\$18", "18", True),
    # expressions, equations, text answers, constants
    (r"x^2+2x+1", r"(x+1)^2", True),
    ("5", "x = 5", True),
    ("3 + 2i", "2i+3", True),
    (r"2\pi", r"\pi \cdot 2", True),
    (r"\frac{\pi}{4}", r"\pi/4", True),
    (r"\pi", "3.14159", False),
    (r"\text{Monday}", "Monday", True),
    (r"\text{(C)}", r"\textbf{(C)}", True),
    (r"\text{Evelyn}", r"\text{Emily}", False),
    # leading zeros / signs (the cases of verl's numeric-canonicalization PR, not merged there; verl's
    # math_reward string check says "033" != "33")
    ("033", "33", True),
    ("+033", "33", True),
    ("-0", "0", True),
    ("000", "0", True),
]


def test_math_table_is_big_and_mixed():
    assert len(MATH_PAIRS) >= 40
    assert sum(eq for *_, eq in MATH_PAIRS) >= 20 and sum(not eq for *_, eq in MATH_PAIRS) >= 15


@pytest.mark.parametrize("gt,answer,equal", MATH_PAIRS)
def test_math_pairs_through_registry(gt, answer, equal):
    response = f"Let's compute step by step.\nSo the final answer is $\\boxed{{{answer}}}$."
    for ds in MATH_DATA_SOURCES:
        got = score(ds, response, gt)
        assert got == (1.0 if equal else 0.0), (ds, gt, answer)
    raw = get_reward_fn("DigitalLearningGmbH/MATH-lighteval")(response, gt)
    assert isinstance(raw, float)  # verl's return type for the MATH data sources


def test_math_boxed_extraction():
    assert extract_boxed_answer(r"first \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"  # the last one
    assert extract_boxed_answer(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # nested / escaped braces
    assert extract_boxed_answer(r"so $\boxed 5$ is it") == "5"  # the space form
    assert extract_boxed_answer(r"\fbox{7}") == "7"
    assert extract_boxed_answer(r"\boxed{unclosed") is None
    assert extract_boxed_answer("no box here") is None
    assert last_boxed_only_string(r"a \boxed{2} b") == r"\boxed{2}"


def test_math_scores_without_a_box_and_with_a_solution_as_ground_truth():
    ds = "HuggingFaceH4/MATH-500"
    assert score(ds, "The answer is 5.", "5") == 0.0  # no \boxed{}
    assert score(ds, r"\boxed{5}", r"We find $x=5$, so the answer is $\boxed{5}$.") == 1.0  # boxed ground truth
    assert score(ds, r"\boxed{4} wait, no: \boxed{5}", "5") == 1.0  # the LAST box counts
    assert score(ds, r"\boxed{5} hmm \boxed{4}", "5") == 0.0
    assert score(ds, "", "5") == 0.0


def test_math_is_checked_on_worker_threads_too():
    """The registry scores on threads when reward.timeout_s is set; math-verify's signal-based limits do not
    work there, so the checks run in child processes: correct answers still score 1.0."""
    gts = [r"\frac{1}{2}", r"2\sqrt{3}", "(1,2]", "7"]
    responses = [r"\boxed{0.5}", r"\boxed{\sqrt{12}}", r"\boxed{(1, 2]}", r"\boxed{8}"]
    scores, nfb = compute_scores(["lighteval/MATH"] * 4, responses, gts, timeout_s=10)
    assert scores == [1.0, 1.0, 1.0, 0.0] and nfb == 0
    out = []
    t = threading.Thread(target=lambda: out.append(math_equal(r"\frac{3}{2}", "1.5")))
    t.start()
    t.join(30)
    assert out == [True]


PATHOLOGICAL = [r"10^{10^{10}}", "10^10^10", r"9^{9^{9^{9}}}", "1000000!", "(" * 300 + "2" + ")" * 300,
                "1" * 5000]


@pytest.mark.parametrize("answer", PATHOLOGICAL, ids=["tower", "tower-flat", "tower4", "factorial", "nested",
                                                       "huge"])
def test_pathological_answer_returns_quickly_with_zero(answer):
    math_equal("1", "1.0")  # a worker started (start-up is not part of the check's limit)
    t0 = time.monotonic()
    assert score("DigitalLearningGmbH/MATH-lighteval", f"\\boxed{{{answer}}}", "1") == 0.0
    assert time.monotonic() - t0 < 8.0
    t0 = time.monotonic()  # through the registry's own per-sample limit, on a worker thread
    scores, _ = compute_scores(["lighteval/MATH"], [f"\\boxed{{{answer}}}"], ["1"], timeout_s=3)
    assert scores == [0.0] and time.monotonic() - t0 < 8.0


def test_stuck_checker_process_is_killed_and_replaced():
    pool = MathCheckPool(max_workers=1)
    try:
        assert pool.check("$1$", "$1.0$") is True
        t0 = time.monotonic()  # math-verify's own limit set far away: only the hard deadline can stop it
        assert pool.check("$1$", "$1000000!$", op_timeout_s=600, hard_timeout_s=1.0) is None
        assert time.monotonic() - t0 < 3.0
        assert pool.check("$2$", r"$\frac{4}{2}$") is True  # a fresh worker took over
    finally:
        pool.close()


# ----------------------------------------------------------------------------- DAPO / AIME

# (response, ground truth, verl math_dapo.compute_score's exact return value)
DAPO_CASES = [
    ("Let me compute. 17 + 17 = 34.\nAnswer: 34", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    ("Answer: 33", "34", {"score": -1.0, "acc": False, "pred": "33"}),
    ("The result is 34.", "34", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    ("answer:34", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    ("ANSWER :  34  ", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    ("Answer: 1\nsome more text\nAnswer: 2", "2", {"score": 1.0, "acc": True, "pred": "2"}),  # the last line
    ("Answer: 1\nsome more text\nAnswer: 2", "1", {"score": -1.0, "acc": False, "pred": "2"}),
    ("Answer: $34$", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    ("Answer: \\boxed{34}", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    ("Answer: x = 34", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    ("Answer: 1,000", "1000", {"score": 1.0, "acc": True, "pred": "1000"}),
    ("Answer: 10 \\text{ cm}", "10", {"score": 1.0, "acc": True, "pred": "10"}),
    ("Answer: \\frac12", "\\frac{1}{2}", {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
    ("Answer: 0.5", "\\frac{1}{2}", {"score": -1.0, "acc": False, "pred": "0.5"}),  # strings, not math
    ("Answer: 90^\\circ", "90", {"score": 1.0, "acc": True, "pred": "90"}),
    ("Answer: 7 dollars", "7", {"score": 1.0, "acc": True, "pred": "7"}),
    ("Answer: 34" + " filler" * 100, "34", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),  # a line > 300 chars
    ("Answer: 34\n" + "x" * 200, "34", {"score": 1.0, "acc": True, "pred": "34"}),
    ("", "34", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
]


@pytest.mark.parametrize("response,gt,expected", DAPO_CASES)
def test_dapo_answer_format_exact_returns(response, gt, expected):
    got = dapo_score(response, gt)
    assert got == expected and type(got["acc"]) is bool and type(got["score"]) is float
    for ds in ("math_dapo", "math", "math_dapo_reasoning", "aime24", "aime2025", "aime_2024"):
        assert get_reward_fn(ds)(response, gt) == expected
        assert score(ds, response, gt) == expected["score"]  # the registry takes "score"


def test_dapo_strict_box_and_normalization():
    assert dapo_score(r"x \boxed{34}", "34", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "34"}
    assert dapo_score(r"\boxed{ 34 }", "34", strict_box_verify=True) == {"score": -1.0, "acc": False,
                                                                        "pred": " 34 "}
    assert dapo_score("no box", "34", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}
    assert normalize_final_answer(r"\text{(B)}") == "(B)"
    assert normalize_final_answer(r"\sqrt3") == r"\sqrt{3}"
    assert normalize_final_answer("5 students") == "5"


def test_aime_prefix_routing():
    assert "aime*" in registered_data_sources()
    assert get_reward_fn("aime24") is get_reward_fn("math_dapo")
    with pytest.raises(KeyError, match="No reward function registered"):
        get_reward_fn("aim")


# ----------------------------------------------------------------------------- NuminaMath (PRIME)

PRIME_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                 "numina_cn_k12", "numina_olympiads")


@pytest.mark.parametrize("response,gt,expected", [
    ("So the final answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("The answer is 5.", "5", 1.0),
    ("Thus x = 7", "7", 1.0),
    ("\\boxed{x = 3}", "3", 1.0),
    ("Therefore, the value is \\boxed{3\\sqrt{2}}.", "\\sqrt{18}", 1.0),
    ("The answer is 6.", "5", 0.0),
    ("no digits here", "5", 0.0),
])
def test_prime_math_sources(response, gt, expected):
    for ds in PRIME_SOURCES:
        got = score(ds, response, gt)
        assert got == expected and isinstance(get_reward_fn(ds)(response, gt), float)


def test_prime_match_answer_follows_verl():
    assert match_answer("The answer is 5.") == (True, "5.")
    assert match_answer("We get 12. Then more words here") == (True, "12")
    assert match_answer("7 is the answer") == (True, "7")
    assert match_answer("Step 1: blah. Step 2: \\boxed{10}. Done") == (True, "10")
    assert match_answer("no digits here") == (False, "no digits here")


# ----------------------------------------------------------------------------- Geometry3K

@pytest.mark.parametrize("response,gt,expected", [
    ("<think>Use the Pythagorean theorem.</think> The answer is \\boxed{2\\sqrt{221}}", "2\\sqrt{221}", 1.0),
    ("The answer is \\boxed{2\\sqrt{221}}", "2\\sqrt{221}", 0.9),  # right, no think tags
    ("<think>\nsteps\n</think>\n\\boxed{10}", "12", 0.1),  # in the format, wrong
    ("<think>angles</think> so \\boxed{60^\\circ}.", "60", 1.0),
    ("<think>steps</think> the answer is 12", "12", 0.0),  # no box: neither accuracy nor format
    ("12", "12", 0.0),
])
def test_geo3k(response, gt, expected):
    got = score("hiyouga/geometry3k", response, gt)
    assert got == pytest.approx(expected) and isinstance(got, float)


# ----------------------------------------------------------------------------- Search-R1 QA

QA_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
              "searchR1_musique", "searchR1_bamboogle", "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
              "musique", "bamboogle")

# (response, ground truth, verl's compute_score, verl's compute_score_subem)
QA_CASES = [
    ("<answer>Paris</answer>", {"target": ["Paris"]}, 1.0, 1.0),
    ("<answer> the Paris! </answer>", {"target": ["paris"]}, 1.0, 1.0),  # articles, punctuation, case
    ("<answer>Lyon</answer>", {"target": ["Paris"]}, 0.0, 0.0),
    ("Paris", {"target": ["Paris"]}, 0.0, 0.0),  # no answer tag
    ("<answer>x</answer> <answer>Paris</answer>", {"target": ["Paris"]}, 1.0, 1.0),  # the last tag
    ("<answer>Paris</answer>" * 11, {"target": ["Paris"]}, 0.25, 1.0),  # tag spam: score / 4
    ("<answer>\nParis\n</answer>", {"target": np.array(["Lyon", "Paris"])}, 1.0, 1.0),  # parquet arrays
    ("<answer>Paris, France</answer>", {"target": ["Paris"]}, 0.0, 1.0),
    ("<answer>An Apple</answer>", {"target": ["apple"]}, 1.0, 1.0),
    ("<answer>George Washington</answer>", {"target": "george washington"}, 1.0, 1.0),
    ("<answer>George Washington</answer>", ["George Washington"], 1.0, 1.0),  # a bare list
]


@pytest.mark.parametrize("response,gt,em,subem", QA_CASES)
def test_search_r1_exact_match(response, gt, em, subem):
    for ds in QA_SOURCES:
        assert score(ds, response, gt) == em
    assert compute_score_subem(response, gt) == subem


# ----------------------------------------------------------------------------- code: refused


def test_code_data_sources_are_refused_with_the_reason():
    for ds in ("codecontests", "apps", "codeforces", "taco"):
        assert ds in CODE_DATA_SOURCES
        with pytest.raises(UnsupportedDataSourceError) as ei:
            get_reward_fn(ds)
        msg = str(ei.value)
        assert ds in msg and "code execution needs a sandbox and is not supported" in msg
        assert isinstance(ei.value, KeyError)
    with pytest.raises(KeyError, match="needs a sandbox"):
        compute_scores(["lighteval/MATH", "apps"], [r"\boxed{1}", "print(1)"], ["1", "{}"])
    assert not any(ds in registered_data_sources() for ds in CODE_DATA_SOURCES)


def test_an_explicit_code_reward_takes_precedence_over_the_refusal():
    @register_reward_fn("taco")
    def sandboxed(solution_str, ground_truth):
        return 0.5

    try:
        assert score("taco", "print(1)", "{}") == 0.5
    finally:
        reg._unregister("taco")
    with pytest.raises(UnsupportedDataSourceError):
        get_reward_fn("taco")


# ----------------------------------------------------------------------------- every verl name, one batch


def test_every_verl_data_source_resolves_and_scores_in_one_manager_batch():
    verl_names = (list(MATH_DATA_SOURCES) + ["math_dapo", "math", "math_dapo_reasoning", "aime24"]
                  + list(PRIME_SOURCES) + ["hiyouga/geometry3k"] + [n for n in QA_SOURCES if n.startswith("searchR1_")]
                  + ["openai/gsm8k"])
    for ds in verl_names:
        assert callable(get_reward_fn(ds))
    responses = [r"\boxed{\frac{1}{2}}", "Answer: 34", "Answer: 33", r"the answer is \boxed{5}",
                 r"<think>t</think>\boxed{12}", "<answer>Paris</answer>", "#### 72"]
    sources = ["DigitalLearningGmbH/MATH-lighteval", "aime2024", "math_dapo", "numina_cn_k12", "hiyouga/geometry3k",
               "searchR1_nq", "openai/gsm8k"]
    gts = ["0.5", "34", "34", "5", "12", {"target": ["paris"]}, "72"]
    scores, metrics = RewardManager([RewardSource("rule")], timeout_s=10).score(responses, sources, gts)
    assert scores == pytest.approx([1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    assert metrics["reward/num_fallbacks"] == 0
