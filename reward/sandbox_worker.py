"""The sandbox worker process: where untrusted checks run (docs/algorithm.md s1).

Runs inside a process spawned by ``reward.sandbox_pool.SandboxPool``. It caps its own address
space, loads its checker (``CheckerSpec.load``: math-verify, or the user's ``reward.function``),
says ``Ready`` and then takes one ``Job`` at a time: it says ``Started`` as soon as it has read
the job, checks it and answers with one ``Outcome``, in order, until it receives ``None`` or
its pipe closes. ``Started`` tells the parent whether a worker that died had read the job in
hand (the job is then charged with the death) or not (the job is sent to another worker). The
parent owns the clock: nothing here times a check.

The messages are small frozen dataclasses pickled over a private pipe between two processes
of the same program; nothing from outside ever reaches ``recv``. A checker turns whatever it
computed into plain ``str``, ``bool`` and ``float`` values before they are sent, so no object
of the checked code (a SymPy value, a user's class) is ever unpickled in the parent.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One item to check.

    Attributes:
        response: the response text, as the checker's spec prepared it (cut, cleaned).
        ground_truth: the ground truth as text.
        extra_info: the data row's ``extra_info`` (only ``reward.function`` reads it).
    """

    response: str
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ready:
    """Sent once the worker has loaded its checker; only then does it get jobs."""


@dataclass(frozen=True)
class StartFailed:
    """Sent instead of ``Ready`` when the checker cannot be loaded; ``reason`` says why."""

    reason: str


@dataclass(frozen=True)
class Started:
    """Sent when the worker has read a ``Job`` and starts checking it (before its ``Outcome``)."""


@dataclass(frozen=True)
class Outcome:
    """The answer to one ``Job``.

    Attributes:
        acc: whether the response is correct.
        pred: the prediction to report.
        error: set when the check failed (it raised, or returned something invalid); the parent
            scores the item ``[ERROR]`` with this as the reason.
        score: the score, when the checker gives one (``reward.function``); ``None`` means
            +1.0 / -1.0 from ``acc``.
        metrics: extra named values from ``reward.function``, all finite floats.
    """

    acc: bool
    pred: str
    error: str | None = None
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


Checker = Callable[[Job], Outcome]
"""Checks one job; must turn any exception of the code it calls into ``Outcome.error``."""


class CheckerLoadError(Exception):
    """The checker cannot be loaded; the message is sent to the parent as ``StartFailed``."""


class CheckerSpec(Protocol):
    """What a sandbox pool runs: picklable, loaded in each worker, used by the parent too."""

    def load(self) -> Checker:
        """In the worker: import what the checker needs and return it.

        Raises:
            CheckerLoadError: the message says why it cannot be loaded.
        """
        ...

    def make_job(self, response: str, ground_truth: str | int, extra_info: dict[str, Any]) -> Job:
        """In the parent: the job to send for one item.

        Raises:
            reward.text.GroundTruthTooLong: the item is refused unsent (an ``[ERROR]`` result).
        """
        ...


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


def worker_main(conn: Connection, memory_limit_bytes: int | None, spec: CheckerSpec) -> None:
    """Entry point of a worker process: load the checker, then answer jobs until ``None``."""
    # Ctrl-C goes to the parent, which kills the workers; tracebacks from each are noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes is not None:
        _limit_memory(memory_limit_bytes)
    try:
        check = spec.load()
    except CheckerLoadError as exc:
        conn.send(StartFailed(str(exc)))
        return
    except Exception as exc:  # worker boundary: tell the parent why, then stop
        conn.send(StartFailed(f"loading the checker raised {type(exc).__name__}: {exc}"[:1000]))
        return
    conn.send(Ready())
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(Started())
        conn.send(check(job))
