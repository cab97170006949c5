"""The math-verify worker process: the only place untrusted text meets SymPy (docs/algorithm.md s1).

Runs inside a process spawned by ``reward.math_verify_pool.MathVerifyPool``. It caps its own
address space, imports math-verify, says ``Ready`` and then takes one ``Job`` at a time: it
says ``Started`` as soon as it has read the job, checks it and answers with one ``Outcome``, in
order, until it receives ``None`` or its pipe closes. ``Started`` tells the parent whether a
worker that died had read the job in hand (the job is then charged with the death) or not (the
job is sent to another worker). The parent owns the clock: math-verify's own ``signal.alarm``
timeouts are switched off here on purpose.

The messages are small frozen dataclasses pickled over a private pipe between two processes
of the same program; nothing from outside ever reaches ``recv``.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType

from reward.result import ERROR_PRED, INVALID
from reward.text import clean_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One pair to check; ``response`` already cut to its tail and cleaned."""

    response: str
    ground_truth: str


@dataclass(frozen=True)
class Ready:
    """Sent once the worker has imported math-verify; only then does it get jobs."""


@dataclass(frozen=True)
class StartFailed:
    """Sent instead of ``Ready`` when math-verify cannot be imported."""

    reason: str


@dataclass(frozen=True)
class Started:
    """Sent when the worker has read a ``Job`` and starts checking it (before its ``Outcome``)."""


@dataclass(frozen=True)
class Outcome:
    """The answer to one ``Job``; ``error`` set means the check raised (pred ``[ERROR]``)."""

    acc: bool
    pred: str
    error: str | None = None


def _gold_text(ground_truth: str) -> str:
    """Put a bare ground truth in a math environment so math-verify's LaTeX reader sees it."""
    if "$" in ground_truth or "\\boxed" in ground_truth:
        return ground_truth
    return f"${ground_truth}$"


def check_pair(math_verify: ModuleType, response: str, ground_truth: str) -> Outcome:
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
        return Outcome(acc=acc, pred=clean_text(pred))
    except Exception as exc:  # worker loop boundary: report, never crash the worker
        return Outcome(acc=False, pred=ERROR_PRED, error=f"{type(exc).__name__}: {exc}"[:500])


def _limit_memory(limit_bytes: int) -> None:
    """Cap this process's address space so a memory bomb raises ``MemoryError``.

    Best effort: ``RLIMIT_AS`` bounds virtual memory, not resident memory, and not every OS
    enforces it; a failure to set it is logged, not fatal.
    """
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit_bytes = min(limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, hard))
    except (ImportError, ValueError, OSError):
        logger.warning("could not cap worker memory at %d bytes", limit_bytes)


def worker_main(conn: Connection, memory_limit_bytes: int | None) -> None:
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
        conn.send(StartFailed(f"cannot import math_verify: {type(exc).__name__}: {exc}"))
        return
    # Warm up (regex compilation, parser set-up: tens of ms) so a first item is not charged
    # for it against its timeout.
    check_pair(math_verify, "Answer: $\\frac{1}{2}$", "0.5")
    conn.send(Ready())
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(Started())
        conn.send(check_pair(math_verify, job.response, job.ground_truth))
