"""The "dapo-reference" verifier reproduces the reference rule;
"dapo-strict" departs only where documented.

``dapo_reference_cases.jsonl`` holds 481 cases, one JSON object a line: ``response``,
``ground_truth``, and the reference implementation's own answer for them, ``acc`` and
``pred`` (produced by running the DAPO reference scorer, verl's ``math_dapo.compute_score``,
on each case; nothing of its code is here). They cover every normalisation step, the
300-character window, several answer lines, raw text (NUL, CR, tabs, no-break spaces), other
Unicode digits and odd spellings of the ground truth. ``strict_departure`` marks the cases that
"dapo-strict" scores differently, and which of its documented departures
(``reward.rules.verify_dapo_strict``) is the cause.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from reward import VerifyResult, make_scorer, verify_dapo_reference, verify_dapo_strict
from reward.rules import DAPO_TAIL_CHARS
from reward.text import clean_text

CASES_FILE = Path(__file__).with_name("dapo_reference_cases.jsonl")
CASES: list[dict[str, Any]] = [json.loads(line) for line in CASES_FILE.read_text().splitlines()]
#: The departures ``verify_dapo_strict``'s docstring lists.
DEPARTURES = {"trailing-period", "commas", "invalid-marker", "nul-bytes"}


def case_id(case: dict[str, Any]) -> str:
    return f"{case['id']}-{case['family']}"


def test_the_table_is_whole() -> None:
    assert len(CASES) == 481
    assert [case["id"] for case in CASES] == list(range(481))
    assert len({(case["response"], case["ground_truth"]) for case in CASES}) == 481
    # Right and wrong answers both, and every kind of departure.
    assert Counter(case["acc"] for case in CASES) == {True: 331, False: 150}
    assert {case.get("strict_departure") for case in CASES} == {None, *DEPARTURES}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_verifier_agrees_with_the_reference(case: dict[str, Any]) -> None:
    result = verify_dapo_reference(case["response"], case["ground_truth"])
    # The reported pred is cleaned for the wire (NUL removed, lone surrogates replaced).
    expected_pred = clean_text(case["pred"])
    assert result == VerifyResult(
        score=1.0 if case["acc"] else -1.0, acc=case["acc"], pred=expected_pred
    )


def test_strict_departs_exactly_on_the_documented_cases() -> None:
    departed = {
        case["id"]: case.get("strict_departure")
        for case in CASES
        if verify_dapo_strict(case["response"], case["ground_truth"]).acc != case["acc"]
    }
    documented = {
        case["id"]: case["strict_departure"] for case in CASES if "strict_departure" in case
    }
    assert departed == documented
    assert Counter(documented.values()) == {
        "commas": 26,
        "trailing-period": 21,
        "invalid-marker": 3,
        "nul-bytes": 1,
    }


@pytest.mark.parametrize(
    ("response", "ground_truth", "reference_acc", "strict_acc"),
    [
        ("Answer: 42.", "42", False, True),  # departure 1: the trailing period
        ("Answer: 1,2", "12", True, False),  # departure 2: a list is not a number
        ("Answer: -1,000", "-1000", False, True),  # departure 2: a grouped negative number
        ("Answer: 1,000.5", "1000.5", False, True),  # departure 2: a grouped decimal
        ("no answer line", "[INVALID]", True, False),  # departure 3: the marker
        ("Answer: 4\x002", "42", False, True),  # departure 4: NUL bytes are cleaned
        ("Answer: 1,000", "1000", True, True),  # no departure
    ],
)
def test_each_documented_departure(
    response: str, ground_truth: str, reference_acc: bool, strict_acc: bool
) -> None:
    assert verify_dapo_reference(response, ground_truth).acc is reference_acc
    assert verify_dapo_strict(response, ground_truth).acc is strict_acc


def test_the_window_is_the_same_300_characters() -> None:
    inside = "Answer: 42\n" + "y" * (DAPO_TAIL_CHARS - len("Answer: 42\n"))
    assert verify_dapo_reference("z" * 1000 + inside, "42").acc
    assert verify_dapo_reference(inside + "y", "42").pred == "[INVALID]"


def test_integer_ground_truths_and_the_scorer() -> None:
    with make_scorer("dapo-reference") as scorer:
        results = scorer.score_many([("Answer: 17", 17), ("Answer: 17.", 17)])
    assert [result.acc for result in results] == [True, False]


def test_pred_is_always_encodable() -> None:
    result = verify_dapo_reference("Answer: 4\x002 \ud800", "42")
    assert result.pred == "42\ufffd"
    result.pred.encode("utf-8")
