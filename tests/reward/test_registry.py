"""The verifier registry and the package's import weight."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reward import VERIFIERS, InProcessScorer, make_scorer, verify_dapo
from reward.text import clean_text, tail

REPO = Path(__file__).resolve().parents[2]


def test_names() -> None:
    assert VERIFIERS == ("dapo", "strict-box", "math-verify")


@pytest.mark.parametrize(
    ("name", "acc"),
    [("dapo", [True, False, False]), ("strict-box", [False, True, False])],
)
def test_in_process_scorers(name: str, acc: list[bool]) -> None:
    pairs: list[tuple[str, str | int]] = [
        ("Answer: 3", 3),
        ("\\boxed{3}", "3"),
        ("nothing", 3),
    ]
    with make_scorer(name) as scorer:
        assert isinstance(scorer, InProcessScorer)
        assert [result.acc for result in scorer.score_many(pairs)] == acc


def test_dapo_scorer_matches_the_function() -> None:
    scorer = make_scorer("dapo")
    assert scorer.score_many([("Answer: 5 cm", "5")]) == [verify_dapo("Answer: 5 cm", "5")]
    scorer.close()


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="dapo, strict-box, math-verify"):
        make_scorer("sympy")


def test_package_is_import_light() -> None:
    code = (
        "import sys, reward, reward.cli; "
        "heavy = {'torch', 'math_verify', 'sympy', 'redis', 'ray', 'vllm'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, cwd=REPO, check=True, timeout=60
    )
    assert proc.stdout.strip() == b"[]"


def test_text_helpers() -> None:
    assert clean_text("a\x00b\ud800") == "ab\ufffd"
    assert tail("abcdef", 3) == "def"
    with pytest.raises(ValueError, match="n_chars=0"):
        tail("abc", 0)
