"""The "math-verify" verifier: symbolic equivalence in killable worker processes (DAPO.md s1).

math-verify parses untrusted text into SymPy. Some inputs never finish (a power tower such as
``10^{10^{10^{10}}}`` hangs in the comparison; 5000 nested ``\\frac{`` hang the parser) and some
could eat memory. So every item runs in a separate, spawned worker process with:

* a hard per-item wall-clock timeout, enforced by the parent: a worker that overruns is killed
  with SIGKILL and replaced, the item scores -1.0 with pred ``[TIMEOUT]`` and ``timeout=True``,
  and ``MathVerifyPool.timeouts`` counts it (a timeout is never hidden);
* an address-space cap (``RLIMIT_AS``, 2 GiB by default) set inside the worker, so a memory bomb
  fails with ``MemoryError`` (pred ``[ERROR]``) instead of exhausting the machine. The cap is
  best effort: it bounds virtual memory, not RSS, and is not enforced on every OS;
* math-verify's own ``signal.alarm`` timeouts switched off: the parent's clock is the only one,
  so every timeout is counted in one place.

Only the last 300 characters of a response are parsed, like the "dapo" verifier, so a 1 MB
response costs what a 300-character one does (and travels cheaply to the worker). An answer
that starts earlier is not seen. The ground truth is parsed whole; without ``$`` or
``\\boxed`` it is wrapped in ``$...$`` because math-verify only reads LaTeX inside a math
environment (a bare ``\\sqrt{2}`` parses to nothing).

Untrusted text reaches only ``math_verify.parse`` (its LaTeX/expression parsers); nothing here
evals it, and only ``str`` values, never SymPy objects, travel back to the parent. Results are
not compared across SymPy's ``str()`` either, which itself can hang on huge numbers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import ModuleType, TracebackType
from typing import Final

from reward.result import CORRECT_SCORE, INVALID, WRONG_SCORE, VerifyResult
from reward.text import clean_text, tail

logger = logging.getLogger(__name__)

#: Characters of the response handed to math-verify (same window as the dapo verifier).
MATH_VERIFY_TAIL_CHARS: Final = 300
#: Default address-space cap of a worker: 2 GiB.
DEFAULT_MEMORY_LIMIT_BYTES: Final = 2 << 30
TIMEOUT_PRED: Final = "[TIMEOUT]"
ERROR_PRED: Final = "[ERROR]"

TIMEOUT_RESULT: Final = VerifyResult(score=WRONG_SCORE, acc=False, pred=TIMEOUT_PRED, timeout=True)
ERROR_RESULT: Final = VerifyResult(score=WRONG_SCORE, acc=False, pred=ERROR_PRED)


class WorkerStartError(RuntimeError):
    """A worker could not start (math-verify missing, or it died before it was ready)."""


# --- messages between the pool and a worker (pickled over a private pipe) -------------------


@dataclass(frozen=True)
class _Job:
    response: str
    ground_truth: str


@dataclass(frozen=True)
class _Ready:
    """Sent once the worker has imported math-verify; only then does it get jobs."""


@dataclass(frozen=True)
class _StartFailed:
    reason: str


@dataclass(frozen=True)
class _Outcome:
    acc: bool
    pred: str
    error: str | None = None


# --- worker side ----------------------------------------------------------------------------


def _gold_text(ground_truth: str) -> str:
    """Put a bare ground truth in a math environment so math-verify's LaTeX reader sees it."""
    if "$" in ground_truth or "\\boxed" in ground_truth:
        return ground_truth
    return f"${ground_truth}$"


def check_pair(math_verify: ModuleType, response: str, ground_truth: str) -> _Outcome:
    """Parse and compare one pair with ``math_verify``; any exception becomes ``[ERROR]``.

    ``response`` is expected already cut to its tail and cleaned. This is the worker's loop
    boundary, hence the catch-all; the error text goes back to the parent, which logs it.
    """
    try:
        gold = math_verify.parse(
            _gold_text(ground_truth), parsing_timeout=None, raise_on_error=True
        )
        answer = math_verify.parse(response, parsing_timeout=None, raise_on_error=True)
        # The extracted string is the last str element; str() of a SymPy value can hang.
        pred = next((item for item in reversed(answer) if isinstance(item, str)), INVALID)
        acc = bool(math_verify.verify(gold, answer, timeout_seconds=None, raise_on_error=True))
        return _Outcome(acc=acc, pred=clean_text(pred))
    except Exception as exc:  # worker loop boundary: report, never crash the worker
        return _Outcome(acc=False, pred=ERROR_PRED, error=f"{type(exc).__name__}: {exc}"[:500])


def _limit_memory(limit_bytes: int) -> None:
    """Cap this process's address space; best effort (see the module docstring)."""
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit_bytes = min(limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, hard))
    except (ImportError, ValueError, OSError):
        logger.warning("could not cap worker memory at %d bytes", limit_bytes)


def _worker_main(conn: Connection, memory_limit_bytes: int | None) -> None:
    """Entry point of a worker process: import math-verify, then answer jobs until ``None``."""
    # Ctrl-C goes to the parent, which kills the workers; tracebacks from each are noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes is not None:
        _limit_memory(memory_limit_bytes)
    # math-verify warns once that its own timeouts are off; they are off on purpose.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        import math_verify
    except Exception as exc:  # worker boundary: tell the parent why, then stop
        conn.send(_StartFailed(f"cannot import math_verify: {type(exc).__name__}: {exc}"))
        return
    conn.send(_Ready())
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(check_pair(math_verify, job.response, job.ground_truth))


# --- parent side ----------------------------------------------------------------------------


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    job_index: int | None = None
    deadline: float = 0.0


class MathVerifyPool:
    """A pool of math-verify worker processes with a hard per-item timeout.

    Use as a context manager, or call ``close()``. Not thread-safe for concurrent callers: a
    lock serialises ``verify_many`` calls.

    Attributes:
        timeouts: items that ran out of time (each one cost a killed and replaced worker).
        errors: items whose check raised, or whose worker died (pred ``[ERROR]``).
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        *,
        memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
        start_timeout_s: float = 60.0,
    ) -> None:
        """Start ``workers`` processes (they import math-verify in the background).

        Args:
            workers: number of worker processes, >= 1.
            timeout_s: hard wall-clock limit per item, seconds, > 0. Counted from the moment
                the item is handed to a ready worker.
            memory_limit_bytes: ``RLIMIT_AS`` of each worker; ``None`` for no cap.
            start_timeout_s: how long a worker may take to import math-verify.
        """
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got workers={workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got timeout_s={timeout_s}")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got start_timeout_s={start_timeout_s}")
        self.timeout_s = timeout_s
        self.memory_limit_bytes = memory_limit_bytes
        self.start_timeout_s = start_timeout_s
        self.timeouts = 0
        self.errors = 0
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        for _ in range(workers):
            self._workers.append(self._spawn())

    # -- lifecycle --

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main,
            args=(child_conn, self.memory_limit_bytes),
            name="math-verify-worker",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    @staticmethod
    def _kill(worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()  # SIGKILL: a worker stuck inside SymPy ignores nothing else
        worker.process.join(timeout=5.0)
        worker.conn.close()

    def _replace(self, position: int) -> None:
        self._kill(self._workers[position])
        self._workers[position] = self._spawn()

    def close(self) -> None:
        """Stop every worker (politely, then with SIGKILL). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            # A pipe already gone is fine: _kill below still reaps the process.
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(None)
        deadline = time.monotonic() + 1.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(worker)
        self._workers.clear()

    def __enter__(self) -> MathVerifyPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- scoring --

    def verify(self, response: str, ground_truth: str | int) -> VerifyResult:
        """Score one pair; see ``verify_many``."""
        return self.verify_many([(response, ground_truth)])[0]

    def score_many(self, pairs: Sequence[tuple[str, str | int]]) -> list[VerifyResult]:
        """``Scorer`` interface: same as ``verify_many``."""
        return self.verify_many(pairs)

    def verify_many(self, pairs: Sequence[tuple[str, str | int]]) -> list[VerifyResult]:
        """Score ``(response, ground_truth)`` pairs in parallel; results in input order.

        Each response is cut to its last 300 characters before it is sent. Raises
        ``WorkerStartError`` if a worker cannot start, ``RuntimeError`` after ``close()``.
        """
        if self._closed:
            raise RuntimeError("MathVerifyPool is closed")
        jobs = [
            _Job(tail(response, MATH_VERIFY_TAIL_CHARS), clean_text(str(truth)))
            for response, truth in pairs
        ]
        with self._lock:
            try:
                return self._run(jobs)
            except WorkerStartError:
                self.close()  # the workers' state is unknown now; the pool cannot be reused
                raise

    def _run(self, jobs: list[_Job]) -> list[VerifyResult]:
        results: list[VerifyResult | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        while pending or any(worker.job_index is not None for worker in self._workers):
            self._dispatch(jobs, pending)
            ready = wait([worker.conn for worker in self._workers], self._wait_budget())
            for position, worker in enumerate(self._workers):
                if worker.conn in ready:
                    self._receive(position, results)
            self._expire(results)
        return [result if result is not None else ERROR_RESULT for result in results]

    def _dispatch(self, jobs: list[_Job], pending: deque[int]) -> None:
        for worker in self._workers:
            if not pending:
                return
            if worker.ready and worker.job_index is None:
                index = pending.popleft()
                try:
                    worker.conn.send(jobs[index])
                except OSError:
                    # The worker died while idle; ``wait`` sees its pipe close and replaces it.
                    pending.appendleft(index)
                    continue
                worker.job_index = index
                worker.deadline = time.monotonic() + self.timeout_s

    def _wait_budget(self) -> float:
        """Seconds until the nearest item deadline or start deadline (never negative)."""
        now = time.monotonic()
        deadlines = [
            worker.deadline if worker.ready else worker.started_at + self.start_timeout_s
            for worker in self._workers
            if worker.job_index is not None or not worker.ready
        ]
        return max(0.0, min(deadlines, default=now + self.timeout_s) - now)

    def _receive(self, position: int, results: list[VerifyResult | None]) -> None:
        worker = self._workers[position]
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._on_worker_death(position, results)
            return
        if isinstance(message, _Ready):
            worker.ready = True
        elif isinstance(message, _StartFailed):
            raise WorkerStartError(message.reason)
        elif isinstance(message, _Outcome) and worker.job_index is not None:
            results[worker.job_index] = self._to_result(message)
            worker.job_index = None

    def _to_result(self, outcome: _Outcome) -> VerifyResult:
        if outcome.error is not None:
            self.errors += 1
            logger.warning("math-verify check failed: %s", outcome.error)
            return ERROR_RESULT
        score = CORRECT_SCORE if outcome.acc else WRONG_SCORE
        return VerifyResult(score=score, acc=outcome.acc, pred=outcome.pred)

    def _on_worker_death(self, position: int, results: list[VerifyResult | None]) -> None:
        worker = self._workers[position]
        if not worker.ready:
            code = worker.process.exitcode
            raise WorkerStartError(f"math-verify worker exited during start-up (exit code {code})")
        if worker.job_index is not None:
            self.errors += 1
            results[worker.job_index] = ERROR_RESULT
            logger.warning(
                "math-verify worker died on item %d (exit code %s); replacing it",
                worker.job_index,
                worker.process.exitcode,
            )
        self._replace(position)

    def _expire(self, results: list[VerifyResult | None]) -> None:
        now = time.monotonic()
        for position, worker in enumerate(self._workers):
            if not worker.ready and now > worker.started_at + self.start_timeout_s:
                raise WorkerStartError(
                    f"math-verify worker not ready after {self.start_timeout_s} s"
                )
            if worker.job_index is not None and now >= worker.deadline:
                if worker.conn.poll():
                    continue  # the answer arrived just in time; the next pass reads it
                self.timeouts += 1
                results[worker.job_index] = TIMEOUT_RESULT
                logger.warning(
                    "math-verify item %d exceeded %.2f s; killing worker pid %s",
                    worker.job_index,
                    self.timeout_s,
                    worker.process.pid,
                )
                self._replace(position)
