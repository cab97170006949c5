"""The "dapo-strict" verifier (alias "dapo"; docs/algorithm.md s1):
extraction and Minerva normalisation.

Its departures from the reference rule are checked case by case in test_dapo_reference.py.
"""

from __future__ import annotations

import pytest

from reward import VerifyResult, normalize_answer, verify_dapo_reference, verify_dapo_strict

FILLER = "x" * 400  # longer than the 300-character window


@pytest.mark.parametrize(
    ("response", "ground_truth", "acc", "pred"),
    [
        # thousands commas, both ways round
        ("Answer: 1,000", 1000, True, "1000"),
        ("Answer: 1000", "1,000", True, "1000"),
        ("Answer: -1,234,567", "-1234567", True, "-1234567"),
        ("Answer: 1,2,3", "123", False, "1,2,3"),  # a list is not a grouped number
        # units
        ("Answer: 5 cm", "5", True, "5"),
        ("Answer: 5\\text{ cm}", "5", True, "5"),
        ("Answer: 10 dollars", 10, True, "10"),
        ("Answer: \\$10", 10, True, "10"),
        # wrappers
        ("Answer: \\boxed{42}", 42, True, "42"),
        ("Answer: $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", True, "\\frac{1}{2}"),
        ("Answer: $42$", 42, True, "42"),
        ("Answer: \\textbf{7}", 7, True, "7"),
        # TeX shorthand, on either side
        ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
        ("Answer: $\\frac{1}{2}$", "\\frac12", True, "\\frac{1}{2}"),
        ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),  # not normalised
        # degrees
        ("Answer: 30^\\circ", 30, True, "30"),
        ("Answer: 30^{\\circ}", "30", True, "30"),
        # text after the last '='
        ("Answer: x = 5", 5, True, "5"),
        # trailing text: same line counts (and spoils it), the next line does not
        ("Answer: 42 because 6*7", 42, False, "42because6*7"),
        ("Answer: 42\nThat is all.", 42, True, "42"),
        # trailing period
        ("Answer: 42.", 42, True, "42"),
        ("Answer: 3.14", "3.14", True, "3.14"),
        # several answer lines: the last wins
        ("Answer: 1\nwait, no.\nAnswer: 2", 2, True, "2"),
        ("Answer: 1\nwait, no.\nAnswer: 2", 1, False, "2"),
        # negative numbers
        ("Answer: -5", -5, True, "-5"),
        ("Answer: -5", 5, False, "-5"),
        # case and spacing of the marker
        ("answer: 7", 7, True, "7"),
        ("ANSWER : 7", "7", True, "7"),
        ("Answer:7", 7, True, "7"),
        ("The final answer: 7", 7, True, "7"),
        # wrong answers
        ("Answer: 41", 42, False, "41"),
        # no answer line
        ("", 42, False, "[INVALID]"),
        ("The answer is 42.", 42, False, "[INVALID]"),
        ("\\boxed{42}", 42, False, "[INVALID]"),
    ],
)
def test_dapo_table(response: str, ground_truth: str | int, acc: bool, pred: str) -> None:
    result = verify_dapo_strict(response, ground_truth)
    assert result == VerifyResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


def test_only_the_last_300_characters_are_seen() -> None:
    inside = "Answer: 42\n" + "y" * (300 - len("Answer: 42\n"))
    assert len(inside) == 300
    assert verify_dapo_strict("z" * 1000 + inside, 42).acc
    # One more character pushes the "A" of "Answer" out of the window.
    outside = "Answer: 42\n" + "y" * (301 - len("Answer: 42\n"))
    assert verify_dapo_strict(outside, 42).pred == "[INVALID]"
    assert verify_dapo_strict("Answer: 42\n" + FILLER, 42).pred == "[INVALID]"


def test_an_answer_outside_the_window_does_not_shadow_the_last_one() -> None:
    response = "Answer: 1\n" + FILLER + "\nAnswer: 42"
    assert verify_dapo_strict(response, 42).acc


def test_integer_ground_truth_equals_its_string() -> None:
    assert verify_dapo_strict("Answer: 17", 17) == verify_dapo_strict("Answer: 17", "17")


def test_invalid_never_matches_a_ground_truth_spelled_invalid() -> None:
    assert not verify_dapo_strict("no answer", "[INVALID]").acc


def test_a_trailing_period_is_a_departure_from_the_reference() -> None:
    assert verify_dapo_strict("Answer: 42.", 42).acc
    assert not verify_dapo_reference("Answer: 42.", 42).acc


@pytest.mark.parametrize(
    "response",
    [
        "Answer: 4\x002",
        "\x00" * 1000 + "Answer: 42",
        "Answer: 42\n\ud800\udfff\ud83d",
        "\udcff" * 500,
        "Answer: \ud800",
    ],
)
def test_surrogates_and_nul_bytes_never_crash(response: str) -> None:
    result = verify_dapo_strict(response, 42)
    assert result.score in (1.0, -1.0)
    result.pred.encode("utf-8")  # always encodable


def test_nul_bytes_are_dropped_and_lone_surrogates_replaced() -> None:
    assert verify_dapo_strict("Answer: 4\x002", 42).acc
    assert verify_dapo_strict("Answer: 42 \ud800", 42).pred == "42\ufffd"


def test_one_megabyte_is_cheap_and_correct() -> None:
    assert verify_dapo_strict("Answer: 1\n" * 100_000 + "Answer: 42", 42).acc


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("x = \\boxed{5}", "5"),
        ("\\text{(B)}", "(B)"),
        ("2\\sqrt3", "2\\sqrt{3}"),
        ("12 square units", "12"),
        (" 7 ", "7"),
        ("\\overline{AB}", "AB"),
        ("5 \\text{ and } 6", "5,6"),
    ],
)
def test_normalize_answer(raw: str, normalised: str) -> None:
    assert normalize_answer(raw) == normalised
