"""Strict and lenient grading of a completer's one-line answer (`first-line`, `first-number`)."""

from __future__ import annotations

import pytest

from reward.result import INVALID
from reward.verifiers import make_scorer


@pytest.mark.parametrize(
    ("response", "strict", "lenient"),
    [
        (" 68\n", True, True),
        ("68", True, True),
        (" 68.\n", False, True),  # a trailing dot: strict wants the number alone
        (" 68 apples\nQ:", False, True),
        (" 86\n", False, False),
        (" 6\n68", False, False),  # the answer is the first line, not a later one
        ("\n68", False, True),  # an empty first line: no strict answer
        (" -68\n", False, False),
    ],
)
def test_strict_and_lenient_grading(response: str, strict: bool, lenient: bool) -> None:
    with make_scorer("first-line") as first_line, make_scorer("first-number") as first_number:
        [strict_result] = first_line.score_many([(response, "68")])
        [lenient_result] = first_number.score_many([(response, "68")])
    assert strict_result.acc is strict and lenient_result.acc is lenient


def test_no_answer_is_invalid_and_scores_minus_one() -> None:
    with make_scorer("first-line") as scorer:
        [result] = scorer.score_many([("   \nA:", "68")])
    assert result.pred == INVALID and result.score == -1.0
