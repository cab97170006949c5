"""The verifier registry and the package's import weight."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from contracts.config import RewardConfig, Verifier
from reward import (
    VERIFIER_ALIASES,
    VERIFIERS,
    InProcessScorer,
    make_scorer,
    verify_dapo_reference,
    verify_dapo_strict,
)
from reward.text import clean_text, tail
from reward.verifiers import VerifyFn

REPO = Path(__file__).resolve().parents[2]


def test_names() -> None:
    assert VERIFIERS == (
        "dapo-reference",
        "dapo-strict",
        "strict-box",
        "math-verify",
        "first-line",
        "first-number",
        "reasoning-gym",
    )
    assert VERIFIER_ALIASES == {"dapo": "dapo-strict"}


def test_the_config_accepts_exactly_the_registered_names() -> None:
    assert set(get_args(Verifier)) == {*VERIFIERS, *VERIFIER_ALIASES}
    assert RewardConfig().verifier == VERIFIERS[0]  # the default is the reference rule


@pytest.mark.parametrize(
    ("name", "acc"),
    [
        ("dapo-reference", [True, False, False, False]),
        ("dapo-strict", [True, False, False, True]),
        ("dapo", [True, False, False, True]),
        ("strict-box", [False, True, False, False]),
    ],
)
def test_in_process_scorers(name: str, acc: list[bool]) -> None:
    pairs: list[tuple[str, str | int]] = [
        ("Answer: 3", 3),
        ("\\boxed{3}", "3"),
        ("nothing", 3),
        ("Answer: 3.", 3),  # a trailing period: only dapo-strict strips it
    ]
    with make_scorer(name) as scorer:
        assert isinstance(scorer, InProcessScorer)
        assert [result.acc for result in scorer.score_many(pairs)] == acc


@pytest.mark.parametrize(
    ("name", "verify"),
    [
        ("dapo", verify_dapo_strict),
        ("dapo-strict", verify_dapo_strict),
        ("dapo-reference", verify_dapo_reference),
    ],
)
def test_dapo_scorers_match_their_functions(name: str, verify: VerifyFn) -> None:
    pairs: list[tuple[str, str | int]] = [("Answer: 5 cm", "5"), ("Answer: 1,2", "12")]
    with make_scorer(name) as scorer:
        assert scorer.score_many(pairs) == [verify(*pair) for pair in pairs]


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(
        ValueError,
        match=(
            "dapo-reference, dapo-strict, strict-box, math-verify, first-line, first-number, "
            "reasoning-gym, dapo"
        ),
    ):
        make_scorer("sympy")


def test_package_is_import_light() -> None:
    code = (
        "import sys, reward, reward.cli; "
        "heavy = {'torch', 'math_verify', 'sympy', 'redis', 'ray', 'vllm', 'reasoning_gym', "
        "'pydantic'} & set(sys.modules); "
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
