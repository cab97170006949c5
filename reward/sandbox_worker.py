"""The sandbox worker process: where untrusted checks run (docs/algorithm.md s1).

Runs inside a process spawned by ``reward.sandbox_pool.SandboxPool``. It caps its own address
space, loads its checker (``CheckerSpec.load``: math-verify, or the user's ``reward.function``),
says ``Ready`` and then takes one ``Job`` at a time: it says ``Started`` as soon as it has read
the job, checks it and answers with one ``Outcome``, in order, until it receives ``None`` or
its pipe closes. ``Started`` tells the parent whether a worker that died had read the job in
hand (the job is then charged with the death) or not (the job is sent to another worker). The
parent owns the clock: nothing here times a check.

Jobs come from the parent pickled (the parent is trusted); everything the worker sends is a
length-prefixed JSON frame (``sandbox.frames``), never a pickle: the checked code runs in this
process and may write anything on the pipe, so the parent reads bytes with a deadline and a
size bound, and builds its own values from plain JSON (``message_of`` / ``outcome_of``).

Before it loads the checker the worker contains it as ``sandbox.worker`` contains a tool (the
same code): a session of its own (the parent kills the whole process group, so what the check
forks dies with it), an environment of PATH, HOME, TMPDIR and LANG only (no Redis URL, no
tracker key), an address-space cap, no core files, bounded file sizes and open files, and an
audit hook that refuses network sockets and new processes.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from sandbox.frames import write_frame
from sandbox.worker import SAFE_ENV, apply_limits, install_guard

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


def _contain(memory_limit_bytes: int | None) -> None:
    """Everything the module docstring promises, before any checked code is imported."""
    os.setsid()
    kept = {k: os.environ[k] for k in SAFE_ENV if k in os.environ}
    os.environ.clear()
    os.environ.update(kept)
    try:
        apply_limits(memory_limit_bytes)
    except (ValueError, OSError):  # best effort where the OS refuses a limit
        logger.warning("could not apply every resource limit to the worker")
    install_guard(allow_processes=False)


def encode_message(message: Ready | StartFailed | Started | Outcome) -> dict[str, Any]:
    if isinstance(message, Outcome):
        return {"type": "outcome", **asdict(message)}
    if isinstance(message, StartFailed):
        return {"type": "start_failed", "reason": message.reason}
    return {"type": "ready" if isinstance(message, Ready) else "started"}


def message_of(frame: dict[str, Any]) -> Ready | StartFailed | Started | Outcome:
    """The parent's reading of a worker's frame; ValueError if it is not one of ours."""
    kind = frame.get("type")
    if kind == "ready":
        return Ready()
    if kind == "started":
        return Started()
    if kind == "start_failed":
        return StartFailed(str(frame.get("reason", ""))[:1000])
    if kind == "outcome":
        return outcome_of(frame)
    raise ValueError(f"a frame of unknown type {str(kind)[:40]!r}")


def outcome_of(frame: dict[str, Any]) -> Outcome:
    acc, pred, error, score, metrics = (
        frame.get(k) for k in ("acc", "pred", "error", "score", "metrics")
    )
    if not isinstance(acc, bool) or not isinstance(pred, str):
        raise ValueError("an outcome without a bool acc and a str pred")
    if error is not None and not isinstance(error, str):
        raise ValueError("an outcome whose error is not a str")
    if score is not None and (
        isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score)
    ):
        raise ValueError("an outcome whose score is not a finite number")
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v)
        for k, v in metrics.items()
    ):
        raise ValueError("an outcome whose metrics are not finite numbers by name")
    return Outcome(
        acc=acc,
        pred=pred[:1000],
        error=None if error is None else error[:1000],
        score=None if score is None else float(score),
        metrics={k[:100]: float(v) for k, v in list(metrics.items())[:64]},
    )


def worker_main(conn: Connection, memory_limit_bytes: int | None, spec: CheckerSpec) -> None:
    """Entry point of a worker process: load the checker, then answer jobs until ``None``."""
    # Ctrl-C goes to the parent, which kills the workers; tracebacks from each are noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = conn.fileno()

    def send(message: Ready | StartFailed | Started | Outcome) -> None:
        write_frame(out, encode_message(message))

    _contain(memory_limit_bytes)
    try:
        check = spec.load()
    except CheckerLoadError as exc:
        send(StartFailed(str(exc)))
        return
    except Exception as exc:  # worker boundary: tell the parent why, then stop
        send(StartFailed(f"loading the checker raised {type(exc).__name__}: {exc}"[:1000]))
        return
    send(Ready())
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        send(Started())
        send(check(job))
