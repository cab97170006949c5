"""Killable worker processes with a hard per-item timeout, for checks that are not safe in-process.

Two verifiers run here (docs/algorithm.md s1): "math-verify", whose SymPy parsing of untrusted
text can hang or eat memory (``reward.math_verify_pool``), and the user's ``reward.function``
(``reward.custom``), which is code this project has never seen. Every item runs in a spawned
worker process (``reward.sandbox_worker``) that loads the checker once, with:

* a hard per-item wall-clock timeout, enforced by this parent: a worker that overruns is killed
  with SIGKILL and replaced, the item scores -1.0 with pred ``[TIMEOUT]``, ``timeout=True`` and
  a reason, and ``SandboxPool.timeouts`` counts it (a timeout is never hidden);
* an address-space cap (``RLIMIT_AS``, 2 GiB by default) set inside the worker, so a memory bomb
  fails with ``MemoryError`` (pred ``[ERROR]``) instead of exhausting the machine. Best effort:
  it bounds virtual memory, not RSS, and is not enforced on every OS;
* an exception inside a check, or a worker that dies while it checks an item, scores that item
  -1.0 with pred ``[ERROR]`` and a ``reason``, counted in ``SandboxPool.errors``; the pool
  carries on. A worker says ``Started`` when it reads an item, so the parent knows which item
  was in hand when it died; a death cannot be told apart from an outside kill (OOM killer,
  operator) during the same check, which is charged to the item too;
* an item handed to a worker that was already dead (it died while idle, or between two items,
  before reading this one) is not charged: it is sent again, to a live or a replacement
  worker, up to ``MAX_ITEM_RETRIES`` times. After that it scores ``[ERROR]`` with a reason
  saying so, so a pool whose workers keep dying ends every call instead of looping.

* what a worker sends is read as length-prefixed JSON frames (``sandbox.frames``) with the
  item's deadline and a size bound, never unpickled: bytes the checked code writes on the pipe
  are a malformed message (the item scores ``[ERROR]``, the worker is replaced), and half a
  message ends at the deadline;
* each worker leads its own process group (a kill takes what it forked), keeps only PATH, HOME,
  TMPDIR and LANG of the environment, and runs under ``sandbox.worker``'s limits and audit hook:
  no network sockets, no new processes, bounded file sizes and open files.

What the isolation does NOT give: the checked code runs with this user's file permissions, so it
can read and write the files this user can; code that calls libc through ctypes gets past the
audit hook (the tool sandbox adds a network namespace; these workers, started by
multiprocessing, do not).

Each worker is sent up to ``PIPELINE_DEPTH`` items at once and answers them in order, so it
never idles waiting for the parent; an item's clock starts when the worker finishes the item
before it (as seen by the parent, which can only make the limit more lenient, never stricter).
When a worker is killed, the items queued behind the stuck one are handed to other workers.

Workers are started with the "spawn" method: a script that creates a pool must guard its entry
point with ``if __name__ == "__main__":``, as for any spawned multiprocessing code.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, Final, TypeVar

from reward.result import CORRECT_SCORE, WRONG_SCORE, VerifyResult, error_result
from reward.sandbox_worker import (
    CheckerSpec,
    Job,
    Outcome,
    Ready,
    Started,
    StartFailed,
    message_of,
    worker_main,
)
from reward.text import GroundTruthTooLong
from sandbox.frames import FrameError, FrameReader

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Default address-space cap of a worker: 2 GiB.
DEFAULT_MEMORY_LIMIT_BYTES: Final = 2 << 30
#: Items queued per worker: 2 hides the pipe round trip while at most one item waits behind a
#: stuck one (it is requeued when the stuck worker is killed).
PIPELINE_DEPTH: Final = 2
#: Consecutive start-up deaths tolerated before ``WorkerStartError``.
MAX_START_FAILURES: Final = 3
#: Times an item is sent again after the worker it was handed to died before reading it. Bounds
#: the work of a pool whose workers keep dying (each retry may wait for a replacement to start);
#: it does not make such a pool useful, only makes it end each call with ``[ERROR]`` results.
MAX_ITEM_RETRIES: Final = 2
TIMEOUT_PRED: Final = "[TIMEOUT]"


class WorkerStartError(RuntimeError):
    """A worker could not start (its checker could not be loaded,
    or it died before it was ready)."""


@dataclass
class _Worker:
    """Parent-side view of one worker process."""

    process: BaseProcess
    conn: Connection
    started_at: float
    reader: FrameReader  # what the worker sends: JSON frames, read with a deadline
    ready: bool = False
    in_flight: deque[int] = field(default_factory=deque)  # item indices, in send order
    head_started: bool = False  # the worker said ``Started`` for the first in-flight item
    head_deadline: float = 0.0  # when the first in-flight item runs out of time


def _kill(worker: _Worker) -> None:
    if worker.process.is_alive():
        # SIGKILL: code stuck in a check (SymPy, a loop) ignores anything gentler. The worker
        # leads its own process group (``sandbox_worker._contain``): what it forked dies too.
        with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
            os.killpg(worker.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        worker.process.kill()
    worker.process.join(timeout=5.0)
    worker.conn.close()


class SandboxPool:
    """A pool of worker processes running one checker, with a hard per-item timeout.

    Use as a context manager, or call ``close()``. A lock serialises concurrent calls
    (``close()`` from another thread waits for a running ``verify_many`` to finish).

    Attributes:
        label: names the checker in every reason and log line (``"math-verify"``).
        timeouts: items that ran out of time (each one cost a killed and replaced worker).
        errors: items scored ``[ERROR]``: the check raised or returned something invalid, the
            worker died while checking the item, or the item met more than
            ``MAX_ITEM_RETRIES`` dead workers. Items the spec refused unsent (an over-long
            ground truth) are not counted here.
    """

    def __init__(
        self,
        spec: CheckerSpec,
        *,
        label: str,
        workers: int = 2,
        timeout_s: float = 5.0,
        memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
        start_timeout_s: float = 60.0,
    ) -> None:
        """Start ``workers`` processes (they load the checker in the background).

        Args:
            spec: what each worker loads and how an item becomes a job.
            label: the checker's name in reasons and logs.
            workers: number of worker processes, >= 1.
            timeout_s: hard wall-clock limit per item, seconds, > 0. Start-up time of a worker
                does not count against it.
            memory_limit_bytes: ``RLIMIT_AS`` of each worker; ``None`` for no cap.
            start_timeout_s: how long a worker may take to load the checker.
        """
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got workers={workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got timeout_s={timeout_s}")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got start_timeout_s={start_timeout_s}")
        self.spec = spec
        self.label = label
        self.timeout_s = timeout_s
        self.memory_limit_bytes = memory_limit_bytes
        self.start_timeout_s = start_timeout_s
        self.timeouts = 0
        self.errors = 0
        self.timeout_result = VerifyResult(
            score=WRONG_SCORE,
            acc=False,
            pred=TIMEOUT_PRED,
            timeout=True,
            reason=f"{label} ran past the {timeout_s:g} s timeout",
        )
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()  # re-entered by close() after a start-up failure
        self._closed = False
        self._start_failures = 0  # consecutive start-up deaths, reset by a ready worker
        self._workers = [self._spawn() for _ in range(workers)]

    # -- lifecycle --

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=worker_main,
            args=(child_conn, self.memory_limit_bytes, self.spec),
            name=f"{self.label}-worker",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return _Worker(
            process=process,
            conn=parent_conn,
            started_at=time.monotonic(),
            reader=FrameReader(parent_conn.fileno()),
        )

    def close(self) -> None:
        """Stop every worker (politely, then with SIGKILL). Idempotent."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
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
            _kill(worker)
        self._workers.clear()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the current workers (they change when a worker is replaced)."""
        return [worker.process.pid for worker in self._workers]

    # -- scoring --

    def wait_ready(self) -> None:
        """Block until every worker has loaded its checker (optional: scoring waits too).

        Raises:
            WorkerStartError: a worker could not start; the pool is closed.
        """
        self._locked(_Batch(self, []).wait_ready)

    def verify(
        self, response: str, ground_truth: str | int, extra_info: Mapping[str, Any] | None = None
    ) -> VerifyResult:
        """Score one pair; see ``verify_many``."""
        extra = None if extra_info is None else [extra_info]
        return self.verify_many([(response, ground_truth)], extra)[0]

    def score_many(
        self,
        pairs: Sequence[tuple[str, str | int]],
        extra_info: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[VerifyResult]:
        """``Scorer`` interface: same as ``verify_many``."""
        return self.verify_many(pairs, extra_info)

    def verify_many(
        self,
        pairs: Sequence[tuple[str, str | int]],
        extra_info: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[VerifyResult]:
        """Score ``(response, ground_truth)`` pairs in parallel; results in input order.

        Args:
            pairs: the items.
            extra_info: one data row's ``extra_info`` per pair (``{}`` each when ``None``).

        An item the spec refuses (a ground truth over ``GROUND_TRUTH_MAX_CHARS`` characters,
        for math-verify) gives ``[ERROR]`` with a reason, unsent.

        Raises:
            WorkerStartError: a worker could not start; the pool is closed.
            RuntimeError: the pool was closed before the call.
            ValueError: ``extra_info`` is not one mapping per pair.
        """
        if extra_info is not None and len(extra_info) != len(pairs):
            raise ValueError(f"{len(extra_info)} extra_info mappings for {len(pairs)} pairs")
        refused: dict[int, VerifyResult] = {}
        jobs: list[Job] = []
        for index, (response, truth) in enumerate(pairs):
            extra = dict(extra_info[index]) if extra_info is not None else {}
            try:
                jobs.append(self.spec.make_job(response, truth, extra))
            except GroundTruthTooLong as exc:
                refused[index] = error_result(str(exc))
        checked = iter(self._locked(_Batch(self, jobs).run))
        return [
            refused[index] if index in refused else next(checked) for index in range(len(pairs))
        ]

    def _locked(self, action: Callable[[], _T]) -> _T:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            try:
                return action()
            except WorkerStartError:
                self.close()  # the workers' state is unknown now; the pool cannot be reused
                raise


class _Batch:
    """One ``verify_many`` call: hands items to workers and collects results by index."""

    def __init__(self, pool: SandboxPool, jobs: list[Job]) -> None:
        self.pool = pool
        self.workers = pool._workers  # replaced in place, so the pool sees new workers
        self.jobs = jobs
        self.pending: deque[int] = deque(range(len(jobs)))
        self.results: list[VerifyResult | None] = [None] * len(jobs)
        # Per item: deaths of workers it was handed to (or next in line for) before they read it.
        self.unread_deaths: list[int] = [0] * len(jobs)

    def run(self) -> list[VerifyResult]:
        """Score every job; return the results in job order."""
        while self.pending or any(worker.in_flight for worker in self.workers):
            self._dispatch()
            self._step()
        # Every item leaves ``pending`` for a worker and comes back with a result or to
        # ``pending``; the fallback only keeps a bug from turning into a crash.
        missing = error_result("no result was recorded for this item (a SandboxPool bug)")
        return [result if result is not None else missing for result in self.results]

    def wait_ready(self) -> None:
        """Return once every worker has started (or raise ``WorkerStartError``)."""
        while not all(worker.ready for worker in self.workers):
            self._step()

    def _step(self) -> None:
        """Wait for messages or the nearest deadline, read the messages, enforce deadlines."""
        ready = wait([worker.conn for worker in self.workers], self._wait_budget())
        for position, worker in enumerate(self.workers):
            if worker.conn in ready:
                self._drain(position)
        self._expire()

    def _dispatch(self) -> None:
        for worker in self.workers:
            while self.pending and worker.ready and len(worker.in_flight) < PIPELINE_DEPTH:
                index = self.pending.popleft()
                try:
                    worker.conn.send(self.jobs[index])
                except OSError:
                    # The worker died while idle. ``wait`` sees its pipe close, and the death
                    # is charged to this item, back at the front (``_settle_in_flight``).
                    self.pending.appendleft(index)
                    break
                if not worker.in_flight:
                    worker.head_deadline = time.monotonic() + self.pool.timeout_s
                worker.in_flight.append(index)

    def _wait_budget(self) -> float:
        """Seconds until the nearest item or start-up deadline (never negative)."""
        deadlines = [
            worker.head_deadline for worker in self.workers if worker.ready and worker.in_flight
        ] + [
            worker.started_at + self.pool.start_timeout_s
            for worker in self.workers
            if not worker.ready
        ]
        now = time.monotonic()
        return max(0.0, min(deadlines, default=now + self.pool.timeout_s) - now)

    def _drain(self, position: int) -> None:
        """Read every message waiting on worker ``position``'s pipe.

        Messages the worker sent before it died are read before its end of file, so a
        ``Started`` or ``Outcome`` is never lost to a death that follows it.
        """
        worker = self.workers[position]
        try:
            alive = worker.reader.feed()
        except OSError:
            alive = False
        while worker.reader.pending():
            try:
                message = message_of(worker.reader.take())
            except (FrameError, ValueError) as exc:
                # The checked code wrote on the pipe: the worker can no longer be believed.
                self._on_bad_message(position, str(exc))
                return
            if isinstance(message, Ready):
                worker.ready = True
                self.pool._start_failures = 0
            elif isinstance(message, StartFailed):
                raise WorkerStartError(message.reason)
            elif isinstance(message, Started) and worker.in_flight:
                worker.head_started = True
            elif isinstance(message, Outcome) and worker.in_flight:
                self.results[worker.in_flight.popleft()] = self._to_result(message)
                worker.head_started = False
                worker.head_deadline = time.monotonic() + self.pool.timeout_s
        if not alive:
            self._on_worker_death(position)

    def _on_bad_message(self, position: int, why: str) -> None:
        """A frame that is not one of ours: the item in hand scores ``[ERROR]``, the worker is
        replaced, the items queued behind it go back."""
        worker = self.workers[position]
        in_flight = list(worker.in_flight)
        if in_flight:
            self.pool.errors += 1
            self.results[in_flight[0]] = error_result(
                f"the {self.pool.label} worker sent a malformed message ({why[:200]})"
            )
            self._requeue(in_flight[1:])
        worker.in_flight.clear()
        logger.warning(
            "%s worker sent a malformed message (%s); replacing it", self.pool.label, why
        )
        self._replace(position)

    def _to_result(self, outcome: Outcome) -> VerifyResult:
        if outcome.error is not None:
            self.pool.errors += 1
            logger.warning("%s check failed: %s", self.pool.label, outcome.error)
            return error_result(f"{self.pool.label}: {outcome.error}")
        score = outcome.score
        if score is None:
            score = CORRECT_SCORE if outcome.acc else WRONG_SCORE
        return VerifyResult(
            score=score, acc=outcome.acc, pred=outcome.pred, metrics=outcome.metrics
        )

    def _requeue(self, indices: list[int]) -> None:
        """Put unread items back at the front of ``pending``, in their order."""
        self.pending.extendleft(reversed(indices))

    def _retry_unread(self, indices: list[int], exit_code: int | None) -> None:
        """Requeue items a worker died before reading (see ``_settle_in_flight``), within the bound.

        An item past ``MAX_ITEM_RETRIES`` scores ``[ERROR]`` instead: without the bound, workers
        that die as soon as they are ready would keep a call looping.
        """
        retry: list[int] = []
        for index in indices:
            self.unread_deaths[index] += 1
            if self.unread_deaths[index] <= MAX_ITEM_RETRIES:
                retry.append(index)
                continue
            self.pool.errors += 1
            self.results[index] = error_result(
                f"not checked: {self.unread_deaths[index]} {self.pool.label} workers died before "
                f"reading it (last exit code {exit_code})"
            )
            logger.error("%s item %d given up: its workers kept dying", self.pool.label, index)
        self._requeue(retry)

    def _replace(self, position: int) -> None:
        """Kill worker ``position`` and start a new one (the caller has settled its items)."""
        _kill(self.workers[position])
        self.workers[position] = self.pool._spawn()

    def _on_worker_death(self, position: int) -> None:
        worker = self.workers[position]
        worker.process.join(timeout=1.0)
        code = worker.process.exitcode
        if not worker.ready:
            # Killed from outside while importing (OOM killer, an operator): retry a few times.
            self.pool._start_failures += 1
            if self.pool._start_failures > MAX_START_FAILURES:
                raise WorkerStartError(
                    f"{self.pool.label} workers exited during start-up {self.pool._start_failures} "
                    f"times in a row (last exit code {code})"
                )
            logger.warning("%s worker exited during start-up (exit code %s)", self.pool.label, code)
        else:
            self._settle_in_flight(worker, code)
        self._replace(position)

    def _settle_in_flight(self, worker: _Worker, exit_code: int | None) -> None:
        """Deal with the items of a worker that died after start-up.

        The item it had said ``Started`` for is charged with the death (``[ERROR]``) and the
        items queued behind it are requeued. A death before it read anything is charged, as a
        retry (``_retry_unread``), to the items it was handed or, if none, to the next pending
        item: a ready worker sits idle while items wait only when its death came before it
        could be given one (it died right after ``Ready``, or a send to it failed). So every
        death either settles an item or uses up a retry, and a call always ends.
        """
        in_flight = list(worker.in_flight)
        if not in_flight and self.pending:
            in_flight = [self.pending.popleft()]
        if not in_flight:
            logger.warning(
                "idle %s worker exited (exit code %s); replacing it", self.pool.label, exit_code
            )
        elif worker.head_started:
            self.pool.errors += 1
            self.results[in_flight[0]] = error_result(
                f"the {self.pool.label} worker died while checking this item (exit code "
                f"{exit_code})"
            )
            logger.warning(
                "%s worker died on item %d (exit code %s); replacing it",
                self.pool.label,
                in_flight[0],
                exit_code,
            )
            self._requeue(in_flight[1:])
        else:
            logger.warning(
                "%s worker exited (exit code %s) before reading items %s; retrying them",
                self.pool.label,
                exit_code,
                in_flight,
            )
            self._retry_unread(in_flight, exit_code)
        worker.in_flight.clear()

    def _expire(self) -> None:
        now = time.monotonic()
        for position, worker in enumerate(self.workers):
            if not worker.ready and now > worker.started_at + self.pool.start_timeout_s:
                raise WorkerStartError(
                    f"{self.pool.label} worker not ready after {self.pool.start_timeout_s} s"
                )
            if not worker.in_flight or now < worker.head_deadline:
                continue
            if worker.reader.pending():
                continue  # the answer arrived just in time; the next pass reads it
            self.pool.timeouts += 1
            self.results[worker.in_flight[0]] = self.pool.timeout_result
            logger.warning(
                "%s item %d exceeded %.2f s; killing worker pid %s",
                self.pool.label,
                worker.in_flight[0],
                self.pool.timeout_s,
                worker.process.pid,
            )
            self._requeue(list(worker.in_flight)[1:])
            worker.in_flight.clear()
            self._replace(position)
