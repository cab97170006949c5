"""A ground truth over ``GROUND_TRUTH_MAX_CHARS`` is an ``[ERROR]`` result with its reason,
never a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reward import VerifyResult, verify_dapo_reference, verify_dapo_strict, verify_strict_box
from reward.text import GROUND_TRUTH_MAX_CHARS, GroundTruthTooLong, ground_truth_text
from reward.verifiers import VerifyFn

REPO = Path(__file__).resolve().parents[2]
OVER_LONG_REASON = "ground truth is 1025 characters long, over GROUND_TRUTH_MAX_CHARS=1024"


def test_the_cap_is_1024_characters() -> None:
    assert GROUND_TRUTH_MAX_CHARS == 1024
    assert ground_truth_text("7" * 1024) == "7" * 1024
    with pytest.raises(GroundTruthTooLong, match="1025 characters"):
        ground_truth_text("7" * 1025)


@pytest.mark.parametrize(
    ("verify", "response"),
    [
        (verify_dapo_strict, "Answer: 7"),
        (verify_dapo_reference, "Answer: 7"),
        (verify_strict_box, "\\boxed{7}"),
    ],
)
def test_in_process_verifiers_refuse_an_over_long_ground_truth(
    verify: VerifyFn, response: str
) -> None:
    at_cap = "7" * GROUND_TRUTH_MAX_CHARS
    assert verify(response, at_cap).pred != "[ERROR]"  # the cap itself is accepted
    assert verify(response, at_cap + "7") == VerifyResult(
        score=-1.0, acc=False, pred="[ERROR]", reason=OVER_LONG_REASON
    )


def test_a_huge_integer_ground_truth_is_refused_without_converting_it() -> None:
    # str() of this integer raises ValueError (Python's 4300-digit limit); it must not be reached.
    result = verify_dapo_strict("Answer: 1", 10**5000)
    assert (result.pred, result.score) == ("[ERROR]", -1.0)
    assert (
        result.reason
        == "ground truth is an integer of more than 1024 digits (GROUND_TRUTH_MAX_CHARS=1024)"
    )


def test_integers_are_measured_by_their_digits() -> None:
    assert ground_truth_text(10**1023) == "1" + "0" * 1023  # 1024 digits
    with pytest.raises(GroundTruthTooLong, match="1025 characters"):
        ground_truth_text(10**1024)
    with pytest.raises(GroundTruthTooLong, match="more than 1024 digits"):
        ground_truth_text(-(2**5000))


def test_cli_reports_the_reason_and_a_huge_integer_literal_is_a_line_error() -> None:
    lines = [
        json.dumps({"response": "Answer: 7", "ground_truth": "7" * 1025}),
        '{"response": "Answer: 1", "ground_truth": 1' + "0" * 5000 + "}",
        json.dumps({"response": "Answer: 7", "ground_truth": 7}),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "reward", "score"],
        input="\n".join(lines).encode(),
        capture_output=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr.decode()  # line 2 is malformed, the rest scored
    records = [json.loads(row) for row in proc.stdout.decode().splitlines()]
    assert records == [
        {"score": -1.0, "acc": False, "pred": "[ERROR]", "reason": OVER_LONG_REASON},
        {
            "error": (
                "line 2: invalid JSON: an integer of more than "
                f"{sys.get_int_max_str_digits()} digits"
            )
        },
        {"score": 1.0, "acc": True, "pred": "7"},
    ]
