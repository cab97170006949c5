"""``python -m reward score``: JSON lines in, JSON lines out, in order (docs/algorithm.md s1)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(
    args: list[str], stdin: bytes, timeout: float = 120.0
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "reward", *args],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


def output_records(proc: subprocess.CompletedProcess[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.stdout.decode().splitlines()]


def line(response: Any, truth: Any) -> bytes:
    return json.dumps({"response": response, "ground_truth": truth}).encode()


def test_mixed_good_and_malformed_lines() -> None:
    lines = [
        line("Answer: 42", 42),  # 1
        b'{"response": "Answer: 1"',  # 2: bad JSON
        b"",  # 3: blank, skipped
        b'{"ground_truth": "1"}',  # 4: missing response
        line("Answer: 1", 1.5),  # 5: float ground truth
        line(7, "7"),  # 6: response not a string
        b"[1, 2]",  # 7: not an object
        line("Answer: 1", True),  # 8: bool is not an answer
        b'{"response": "Answer: \xff\xfe 3", "ground_truth": "3"}',  # 9: invalid UTF-8 bytes
        b"   ",  # 10: blank
        line("Answer: 1,000", "1000"),  # 11
        line("no answer", "5"),  # 12
        b"[" * 100_000,  # 13: nesting bomb
    ]
    proc = run_cli(["score"], b"\n".join(lines) + b"\n")
    assert proc.returncode == 1, proc.stderr.decode()
    records = output_records(proc)
    assert len(records) == 11  # one per non-blank line
    assert records[0] == {"score": 1.0, "acc": True, "pred": "42"}
    errors = [record["error"] for record in records[1:7]]
    assert errors[0].startswith("line 2: invalid JSON")
    assert errors[1] == "line 4: missing key 'response'"
    assert errors[2] == "line 5: 'ground_truth' must be a string or integer, got float"
    assert errors[3] == "line 6: 'response' must be a string, got int"
    assert errors[4] == "line 7: expected a JSON object, got list"
    assert errors[5] == "line 8: 'ground_truth' must be a string or integer, got bool"
    assert records[7]["acc"] is False and "\ufffd" in records[7]["pred"]
    assert records[8] == {"score": 1.0, "acc": True, "pred": "1000"}
    assert records[9] == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert records[10] == {"error": "line 13: invalid JSON: nested too deeply"}


def test_all_good_exits_zero_and_strict_box_works() -> None:
    stdin = b"\n".join([line("so \\boxed{12}", 12), line("so \\boxed{1}", 2)])  # no final newline
    proc = run_cli(["score", "--verifier", "strict-box"], stdin)
    assert proc.returncode == 0, proc.stderr.decode()
    assert output_records(proc) == [
        {"score": 1.0, "acc": True, "pred": "12"},
        {"score": -1.0, "acc": False, "pred": "1"},
    ]


def test_surrogate_escapes_in_json_are_scored() -> None:
    stdin = b'{"response": "Answer: 42 \\ud800", "ground_truth": 42}\n'
    proc = run_cli(["score"], stdin)
    assert proc.returncode == 0
    assert output_records(proc)[0]["pred"] == "42\ufffd"


def test_empty_input() -> None:
    proc = run_cli(["score"], b"")
    assert (proc.returncode, proc.stdout) == (0, b"")


def test_five_thousand_lines_of_dapo_scoring() -> None:
    stdin = b"\n".join(line(f"work...\nAnswer: {n}", n if n % 3 else n + 1) for n in range(5000))
    start = time.monotonic()
    proc = run_cli(["score"], stdin)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0
    records = output_records(proc)
    assert len(records) == 5000
    assert [record["acc"] for record in records] == [n % 3 != 0 for n in range(5000)]
    assert elapsed < 30.0  # a sanity bound; it takes well under a second of scoring


def test_math_verify_through_the_cli() -> None:
    stdin = b"\n".join(
        [
            line("Answer: 0.5", "\\frac{1}{2}"),
            line("Answer: $10^{10^{10^{10}}}$", 1),
            b"not json",
            line("Answer: $\\sqrt{2}$", "\\sqrt2"),
        ]
    )
    proc = run_cli(["score", "--verifier", "math-verify", "--timeout", "1"], stdin)
    assert proc.returncode == 1, proc.stderr.decode()
    records = output_records(proc)
    assert records[0] == {"score": 1.0, "acc": True, "pred": "0.5", "timeout": False}
    assert records[1] == {
        "score": -1.0,
        "acc": False,
        "pred": "[TIMEOUT]",
        "timeout": True,
        "reason": "math-verify ran past the 1 s timeout",
    }
    assert records[2]["error"].startswith("line 3: invalid JSON")
    assert records[3]["acc"] is True


@pytest.mark.parametrize("args", [["--help"], ["score", "--help"]])
def test_help(args: list[str]) -> None:
    proc = run_cli(args, b"")
    assert proc.returncode == 0
    assert b"score" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["score", "--verifier", "sympy"],
        ["score", "--timeout", "0"],
        ["score", "--workers", "0"],
        [],
    ],
)
def test_bad_arguments_exit_2(args: list[str]) -> None:
    proc = run_cli(args, b"")
    assert proc.returncode == 2
