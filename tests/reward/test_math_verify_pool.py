"""The math-verify verifier in killable workers (docs/algorithm.md s1): equivalence, hostile input, timeouts."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from reward import MathVerifyPool, VerifyResult, WorkerStartError, make_scorer
from reward.math_verify_worker import check_pair

pytest.importorskip("math_verify")

TIMEOUT_S = 1.0
# Hangs in math-verify's comparison for far longer than any timeout used here.
POWER_TOWER = "Answer: $10^{10^{10^{10}}}$"
DEEP_FRACS = "Answer: $" + "\\frac{" * 5000 + "1" + "}{2}" * 5000 + "$"


@pytest.fixture(scope="module")
def pool() -> Iterator[MathVerifyPool]:
    with MathVerifyPool(workers=2, timeout_s=TIMEOUT_S) as shared:
        shared.wait_ready()
        yield shared


def _timed(pool: MathVerifyPool, response: str, truth: str | int) -> tuple[VerifyResult, float]:
    start = time.monotonic()
    result = pool.verify(response, truth)
    return result, time.monotonic() - start


@pytest.mark.parametrize(
    ("response", "truth", "acc"),
    [
        ("Answer: 0.5", "\\frac{1}{2}", True),
        ("Answer: $\\frac{1}{2}$", "0.5", True),
        ("Answer: $\\frac12$", "\\frac{1}{2}", True),
        ("Answer: $\\sqrt2$", "\\sqrt{2}", True),  # a bare gold is wrapped in $...$
        ("Answer: $\\frac{\\pi}{2}$", "\\pi/2", True),
        ("The answer is \\boxed{1,000}.", 1000, True),
        ("Answer: 41", 42, False),
        ("Answer: $\\frac{1}{3}$", "0.33", False),
    ],
)
def test_symbolic_equivalence(pool: MathVerifyPool, response: str, truth: str, acc: bool) -> None:
    result = pool.verify(response, truth)
    assert result.acc is acc
    assert result.score == (1.0 if acc else -1.0)
    assert not result.timeout


def test_no_answer_is_invalid(pool: MathVerifyPool) -> None:
    assert pool.verify("I do not know.", 42) == VerifyResult(-1.0, False, "[INVALID]")


def test_power_tower_times_out_and_is_counted(pool: MathVerifyPool) -> None:
    before_timeouts, before_pids = pool.timeouts, set(pool.pids)
    result, elapsed = _timed(pool, POWER_TOWER, 42)
    assert result == VerifyResult(score=-1.0, acc=False, pred="[TIMEOUT]", timeout=True)
    assert elapsed < TIMEOUT_S + 2.0
    assert pool.timeouts == before_timeouts + 1
    killed = before_pids - set(pool.pids)
    assert len(killed) == 1  # exactly the stuck worker was replaced
    with pytest.raises(ProcessLookupError):
        os.kill(killed.pop(), 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "response", "pred"),
    [
        ("deep-fracs", DEEP_FRACS, "[INVALID]"),  # cut to 300 characters: no complete formula
        ("one-megabyte", "lorem ipsum " * 90_000 + "\nAnswer: 42", "42"),
        ("surrogates", "\ud800 Answer: 42 \udfff", "42"),
        ("nul-bytes", "\x00" * 100 + "Answer: 4\x002" + "\x00", "42"),
    ],
)
def test_hostile_input_returns_in_time(
    pool: MathVerifyPool, name: str, response: str, pred: str
) -> None:
    result, elapsed = _timed(pool, response, 42)
    assert elapsed < TIMEOUT_S + 2.0, name
    assert result.pred == pred
    result.pred.encode("utf-8")


def test_tiny_timeout_on_expensive_input() -> None:
    with MathVerifyPool(workers=1, timeout_s=0.05) as tiny:
        tiny.wait_ready()
        before = tiny.pids
        result = tiny.verify(POWER_TOWER, 1)
        assert result == VerifyResult(score=-1.0, acc=False, pred="[TIMEOUT]", timeout=True)
        assert tiny.timeouts == 1
        assert tiny.pids != before


def test_order_is_kept_around_timeouts(pool: MathVerifyPool) -> None:
    pairs: list[tuple[str, str | int]] = [
        ("Answer: 1", 1),
        (POWER_TOWER, 1),
        ("Answer: 2", 2),
        ("Answer: 5", 3),
        (POWER_TOWER, 1),
        *[(f"Answer: {n}", n) for n in range(10, 30)],
    ]
    results = pool.verify_many(pairs)
    assert [r.timeout for r in results] == [False, True, False, False, True] + [False] * 20
    assert [r.acc for r in results] == [True, False, True, False, False] + [True] * 20


def test_a_worker_that_dies_gives_an_error_result(pool: MathVerifyPool) -> None:
    pool.wait_ready()  # earlier tests replaced workers; kill only started ones
    before = pool.errors
    victims = [pid for pid in pool.pids if pid is not None]
    # Kill every worker while the power tower is being checked (it would run for seconds).

    def kill_all() -> None:
        for pid in victims:
            os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(0.3, kill_all)
    timer.start()
    result = pool.verify(POWER_TOWER, 1)
    timer.join()
    assert result == VerifyResult(score=-1.0, acc=False, pred="[ERROR]")
    assert pool.errors == before + 1
    assert pool.verify("Answer: 7", 7).acc  # the pool carried on with new workers


def test_an_exception_in_a_check_becomes_error() -> None:
    def explode(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("simulated allocation failure")

    outcome = check_pair(SimpleNamespace(parse=explode, verify=explode), "Answer: 1", "1")  # type: ignore[arg-type]
    assert (outcome.acc, outcome.pred) == (False, "[ERROR]")
    assert outcome.error is not None and "MemoryError" in outcome.error


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="needs /proc")
def test_workers_have_an_address_space_cap(pool: MathVerifyPool) -> None:
    pool.wait_ready()
    pid = pool.pids[0]
    limits = Path(f"/proc/{pid}/limits").read_text()
    line = next(row for row in limits.splitlines() if row.startswith("Max address space"))
    assert str(2 << 30) in line


def test_a_worker_that_cannot_start_is_an_error() -> None:
    # 32 MiB of address space is too little to import SymPy (about 60 MiB are needed).
    broken = MathVerifyPool(workers=1, memory_limit_bytes=32 << 20, start_timeout_s=30.0)
    with pytest.raises(WorkerStartError, match="cannot import math_verify"):
        broken.verify("Answer: 1", 1)
    with pytest.raises(RuntimeError, match="closed"):
        broken.verify("Answer: 1", 1)


def test_close_stops_the_workers() -> None:
    scorer = make_scorer("math-verify", timeout_s=2.0, workers=1)
    assert isinstance(scorer, MathVerifyPool)
    assert scorer.score_many([("Answer: 3", 3)])[0].acc
    pids = [pid for pid in scorer.pids if pid is not None]
    scorer.close()
    scorer.close()  # idempotent
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="workers=0"):
        MathVerifyPool(workers=0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        MathVerifyPool(timeout_s=0)
