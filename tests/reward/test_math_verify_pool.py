"""The math-verify verifier in killable workers (docs/algorithm.md s1):
equivalence, hostile input, timeouts."""

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
from reward.math_verify_pool import MAX_ITEM_RETRIES
from reward.math_verify_worker import check_pair
from reward.text import GROUND_TRUTH_MAX_CHARS

pytest.importorskip("math_verify")

TIMEOUT_S = 1.0
# Hangs in math-verify's comparison for far longer than any timeout used here.
POWER_TOWER = "Answer: $10^{10^{10^{10}}}$"
DEEP_FRACS = "Answer: $" + "\\frac{" * 5000 + "1" + "}{2}" * 5000 + "$"


#: The response that makes the stand-in math_verify (below) block, followed by a file path.
BLOCK = "BLOCK"

#: A stand-in for math_verify, put first on the path of the workers a test starts: "Answer: X"
#: parses to ["X"] and equal strings verify. A response "BLOCK" creates `started` in the worker's
#: own directory (the only one it may write), so the test knows the worker is checking it, and
#: then hangs until the worker is killed.
FAKE_MATH_VERIFY = f"""
import pathlib
import time


def parse(text, **kwargs):
    if text.startswith("{BLOCK}"):
        pathlib.Path("started").touch()
        time.sleep(3600)
    return [text.rsplit(":", 1)[-1].strip().strip("$")]


def verify(gold, answer, **kwargs):
    return gold == answer
"""

#: A stand-in whose worker starts, says it is ready, then exits (code 3) instead of reading a job.
DIES_WHEN_IDLE = """
import os
import sys


def _exit_instead_of_reading(*args, **kwargs):
    os._exit(3)


sys.modules["__main__"].read_frame_blocking = _exit_instead_of_reading  # the worker's loop


def parse(text, **kwargs):
    return [text]


def verify(gold, answer, **kwargs):
    return False
"""


@pytest.fixture(scope="module")
def pool() -> Iterator[MathVerifyPool]:
    with MathVerifyPool(workers=2, timeout_s=TIMEOUT_S) as shared:
        shared.wait_ready()
        yield shared


@pytest.fixture(scope="module")
def lone_pool() -> Iterator[MathVerifyPool]:
    """One worker, a timeout no test reaches: its tests kill the worker on purpose."""
    with MathVerifyPool(workers=1, timeout_s=60.0) as lone:
        lone.wait_ready()
        yield lone


def _install_fake_math_verify(
    directory: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """Make workers started from now on import ``source`` as math_verify (spawn copies sys.path)."""
    (directory / "math_verify.py").write_text(source)
    monkeypatch.syspath_prepend(str(directory))


@pytest.fixture
def fake_math_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _install_fake_math_verify(tmp_path, monkeypatch, FAKE_MATH_VERIFY)
    return tmp_path


def _only_pid(pool: MathVerifyPool) -> int:
    (pid,) = pool.pids
    assert pid is not None
    return pid


def _wait_until_stopped(pid: int) -> None:
    """Wait until ``pid`` is in state T (stopped), as /proc reports it."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.01)
    raise AssertionError(f"worker {pid} did not stop")


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
    assert result == VerifyResult(
        score=-1.0,
        acc=False,
        pred="[TIMEOUT]",
        timeout=True,
        reason="math-verify ran past the 1 s timeout",
    )
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
        assert (result.score, result.acc, result.pred, result.timeout) == (
            -1.0,
            False,
            "[TIMEOUT]",
            True,
        )
        assert result.reason == "math-verify ran past the 0.05 s timeout"
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


def test_a_worker_that_dies_gives_an_error_result(fake_math_verify: Path) -> None:
    with MathVerifyPool(workers=2, timeout_s=120.0) as pool:
        pool.wait_ready()
        victims = [pid for pid in pool.pids if pid is not None]
        homes = [Path(os.readlink(f"/proc/{pid}/cwd")) for pid in victims]

        def kill_all_once_busy() -> None:
            # Only once a worker is checking the item (it created the file), never before.
            deadline = time.monotonic() + 60.0
            while not any((h / "started").exists() for h in homes):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            for pid in victims:  # the busy worker and the idle one
                os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_all_once_busy)
        killer.start()
        result = pool.verify(BLOCK, 1)
        killer.join()
        assert (result.score, result.acc, result.pred) == (-1.0, False, "[ERROR]")
        assert result.reason == (
            "the math-verify worker died while checking this item (exit code -9)"
        )
        assert pool.errors == 1
        # The idle worker died too; an item handed to it is retried on a replacement.
        assert pool.verify("Answer: 7", 7) == VerifyResult(1.0, True, "7")
        assert pool.errors == 1


def test_a_worker_killed_while_idle_costs_no_correct_answer(lone_pool: MathVerifyPool) -> None:
    for _ in range(3):
        lone_pool.wait_ready()
        os.kill(_only_pid(lone_pool), signal.SIGKILL)
        # Sent at once, the item often reaches the worker before its pipe is closed: the
        # worker never reads it, so it is retried on the replacement, not scored -1.
        assert lone_pool.verify("Answer: 7", 7) == VerifyResult(1.0, True, "7")
    assert lone_pool.errors == 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_an_item_the_worker_never_read_is_retried(lone_pool: MathVerifyPool) -> None:
    lone_pool.wait_ready()
    pid = _only_pid(lone_pool)
    os.kill(pid, signal.SIGSTOP)  # frozen, the worker cannot read what it is sent
    _wait_until_stopped(pid)
    # The kill lands after the send (0.5 s is ample) or, on a stalled machine, before it; either
    # way the worker dies without reading the item, which must be checked by the replacement.
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    result = lone_pool.verify("Answer: 7", 7)
    killer.join()
    assert result == VerifyResult(1.0, True, "7")
    assert lone_pool.errors == 0


def test_workers_that_keep_dying_give_error_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_fake_math_verify(tmp_path, monkeypatch, DIES_WHEN_IDLE)
    with MathVerifyPool(workers=1, timeout_s=60.0, start_timeout_s=60.0) as pool:
        results = pool.verify_many([("Answer: 1", 1), ("Answer: 2", 2)])
        reason = (
            f"not run: {MAX_ITEM_RETRIES + 1} math-verify workers died before reading it "
            "(last exit code 3)"
        )
        assert results == [VerifyResult(-1.0, False, "[ERROR]", reason=reason)] * 2
        assert pool.errors == 2


def test_an_over_long_ground_truth_is_an_error_without_a_worker(pool: MathVerifyPool) -> None:
    before = pool.errors
    results = pool.verify_many(
        [("Answer: 1", "1" * (GROUND_TRUTH_MAX_CHARS + 1)), ("Answer: 2", 2)]
    )
    assert results[0].pred == "[ERROR]" and results[0].score == -1.0
    assert results[0].reason is not None and "GROUND_TRUTH_MAX_CHARS=1024" in results[0].reason
    assert results[1].acc
    assert pool.errors == before


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
    with pytest.raises(WorkerStartError, match=r"^cannot import math_verify: MemoryError"):
        MathVerifyPool(workers=1, memory_limit_bytes=32 << 20, start_timeout_s=30.0)
    pool = MathVerifyPool(workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.verify("Answer: 1", 1)


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
