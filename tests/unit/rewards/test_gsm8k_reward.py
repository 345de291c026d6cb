"""GSM8K rule reward: extraction and scoring on many answer shapes."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rlhf.rewards.gsm8k import compute_score, extract_solution, numbers_equal, parse_number  # noqa: E402

# (response, ground_truth, expected strict score) with score=1.0, format_score=0.0
STRICT_CASES = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 72", "72", 1.0),
    ("####72", "72", 1.0),  # no space after the marker
    ("#### 72", "73", 0.0),  # wrong number
    ("#### 1,000", "1000", 1.0),  # thousands comma in the response
    ("#### 1000", "1,000", 1.0),  # thousands comma in the ground truth
    ("#### 1,234,567", "1234567", 1.0),
    ("#### $18", "18", 1.0),  # dollar sign
    ("#### $ 18", "18", 1.0),
    ("#### 18.", "18", 1.0),  # trailing period
    ("#### 18.00", "18", 1.0),  # decimals compare numerically
    ("#### 18.5", "18.50", 1.0),
    ("#### 18.5", "18", 0.0),
    ("#### -5", "-5", 1.0),  # negatives
    ("#### -5", "5", 0.0),
    ("#### \u22125", "-5", 1.0),  # unicode minus
    ("#### $-5", "-5", 1.0),
    ("####   72  \n", "72", 1.0),  # surrounding whitespace
    ("#### $1,000.50.", "1000.5", 1.0),
    ("The answer is 72.", "72", 0.0),  # missing #### -> no answer in strict mode
    ("", "72", 0.0),
    ("#### seventy-two", "72", 0.0),  # marker without a number is no answer
    ("#### 72 apples", "72", 1.0),  # trailing words after the number
    ("#### 72apples", "72", 1.0),  # trailing unit glued to the number
    # multiple ####: the FIRST #### N is the committed answer
    ("#### 72\nQuestion: Bob has 3 pens and buys 5.\n#### 8", "72", 1.0),
    ("#### 72\nQuestion: Bob has 3 pens and buys 5.\n#### 8", "8", 0.0),
    ("#### the answer follows\n#### 72", "72", 1.0),  # markers without numbers are skipped
    ("#####  72", "72", 1.0),
    ("#### 3,4", "3", 1.0),  # not thousands grouping -> the number is 3
    # long output: the answer sits far more than 300 chars before the end (verl would miss it)
    ("#### 72\n" + "blah " * 200, "72", 1.0),
    ("work " * 200 + "\n#### 72", "72", 1.0),
]


@pytest.mark.parametrize("response,gt,expected", STRICT_CASES)
def test_strict_score_table(response, gt, expected):
    assert compute_score(response, gt) == expected
    assert isinstance(compute_score(response, gt), float)


# (response, expected flexible extraction)
FLEXIBLE_CASES = [
    ("48 + 24 = 72 clips", "72"),
    ("She earned $10.", "10"),
    ("The total is 1,000 dollars and 5 cents", "5"),
    ("Result: 18.00", "18.00"),
    ("It dropped to -3 degrees", "-3"),
    ("from 3-5 items", "5"),  # hyphen between digits is not a minus sign
    ("numbers 3,4", "4"),
    ("The answer is 7. Version mp3 and H2O and abc123def", "7"),  # numbers inside words ignored
    ("It weighs 5kg", "5"),  # trailing unit allowed
    ("no numbers here", None),
    ("....", None),
    ("#### 72\nthen 8 more", "8"),
]


@pytest.mark.parametrize("response,expected", FLEXIBLE_CASES)
def test_flexible_extraction_table(response, expected):
    assert extract_solution(response, method="flexible") == expected


STRICT_EXTRACT_CASES = [
    ("#### 1,000", "1000"),
    ("#### $18.00.", "18.00"),
    ("#### -5", "-5"),
    ("#### 72\n#### 8", "72"),
    ("no marker 72", None),
    ("abc123 #### x", None),
]


@pytest.mark.parametrize("response,expected", STRICT_EXTRACT_CASES)
def test_strict_extraction_table(response, expected):
    assert extract_solution(response, method="strict") == expected


def test_flexible_scoring():
    assert compute_score("so the answer is 72", "72", method="flexible") == 1.0
    assert compute_score("so the answer is 72, not 71", "72", method="flexible") == 0.0
    assert compute_score("so the answer is $1,000.00.", "1000", method="flexible") == 1.0
    assert compute_score("no digits", "72", method="flexible") == 0.0


def test_format_score_and_score_values():
    # format present, wrong number -> format_score
    assert compute_score("#### 71", "72", format_score=0.1) == pytest.approx(0.1)
    # no answer -> 0 even with a format_score
    assert compute_score("I think 72", "72", format_score=0.1) == 0.0
    # custom score on success
    assert compute_score("#### 72", "72", format_score=0.1, score=2.5) == 2.5
    assert compute_score("71", "72", method="flexible", format_score=0.2) == pytest.approx(0.2)


def test_ground_truth_types():
    assert compute_score("#### 72", 72) == 1.0
    assert compute_score("#### 0.5", 0.5) == 1.0
    assert compute_score("#### 72", " 72 ") == 1.0
    assert compute_score("#### 72", "#### 72") == 1.0  # a full reference answer is accepted


def test_errors():
    with pytest.raises(ValueError, match="method='fuzzy'"):
        extract_solution("#### 1", method="fuzzy")
    with pytest.raises(ValueError, match="seventy"):
        compute_score("#### 70", "seventy")
    with pytest.raises(ValueError):
        parse_number("")


def test_numbers_equal():
    assert numbers_equal("18.00", 18)
    assert numbers_equal("$1,000", "1000.0")
    assert not numbers_equal("-5", "5")
    assert extract_solution(None) is None
