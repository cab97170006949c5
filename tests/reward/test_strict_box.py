"""Strict-box mode (docs/algorithm.md s1):
last brace-matched \\boxed{} in the last 100 characters."""

from __future__ import annotations

import pytest

from reward import VerifyResult, verify_strict_box
from reward.rules import last_boxed_content


@pytest.mark.parametrize(
    ("response", "ground_truth", "acc", "pred"),
    [
        ("so \\boxed{42}", 42, True, "42"),
        ("so \\boxed{42}", "42", True, "42"),
        ("so \\boxed{ 42 }", "42", True, "42"),  # whitespace only is stripped
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\frac{1}{2}}", "\\frac12", False, "\\frac{1}{2}"),  # raw equality
        ("\\boxed{{a}{b{c}}} done", "{a}{b{c}}", True, "{a}{b{c}}"),
        ("\\boxed{1,000}", 1000, False, "1,000"),  # no normalisation at all
        ("\\boxed{1}, then \\boxed{2}", 2, True, "2"),  # the last box wins
        ("\\boxed{1}, then \\boxed{2}", 1, False, "2"),
        ("\\boxed{}", "", True, ""),
        ("Answer: 42", 42, False, "[INVALID]"),
        ("", 42, False, "[INVALID]"),
        ("\\boxed{42", 42, False, "[INVALID]"),  # never closed
        ("\\boxed{42} and \\boxed{4", 42, False, "[INVALID]"),  # the last box is unclosed
    ],
)
def test_strict_box_table(response: str, ground_truth: str | int, acc: bool, pred: str) -> None:
    result = verify_strict_box(response, ground_truth)
    assert result == VerifyResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


def test_only_the_last_100_characters_are_seen() -> None:
    boxed = "\\boxed{42}"
    assert verify_strict_box(boxed + "x" * (100 - len(boxed)), 42).acc
    assert verify_strict_box(boxed + "x" * (101 - len(boxed)), 42).pred == "[INVALID]"


def test_last_boxed_content() -> None:
    assert last_boxed_content("a \\boxed{x^{2}} b") == "x^{2}"
    assert last_boxed_content("no box") is None


@pytest.mark.parametrize("response", ["\\boxed{\ud800}", "\\boxed{4\x002}", "\x00\udfff" * 100])
def test_hostile_text_never_crashes(response: str) -> None:
    result = verify_strict_box(response, 42)
    result.pred.encode("utf-8")
