"""Checks that are not safe in the reward service's process, run in the project's sandbox.

Three verifiers run here (docs/algorithm.md s1): "math-verify", whose SymPy parsing of untrusted
text can hang or eat memory (``reward.math_verify_pool``), "reasoning-gym", whose task scorers
may evaluate what they read (``reward.gym_checker``), and the user's ``reward.function``
(``reward.custom``), which is code this project has never seen. Both go through
``sandbox.pool.Sandbox``, the one sandbox tools use too: every worker is a fresh ``python -I``
with a private directory, four environment variables and no inherited descriptor, confined by
Landlock and seccomp (``sandbox.confine``: no network, no new process, no file outside its
directory written, no run directory read, no signal to a service). Each worker loads the
checker once (``reward.checking.serve``) and then checks one item at a time:

* a hard per-item wall-clock timeout: a worker that overruns is killed (its process group with
  it) and replaced; the item scores -1.0 with pred ``[TIMEOUT]``, ``timeout=True`` and a reason,
  and ``SandboxPool.timeouts`` counts it (a timeout is never hidden);
* an address-space cap (2 GiB by default), so a memory bomb fails with ``MemoryError`` (pred
  ``[ERROR]``) instead of exhausting the machine;
* an exception inside a check, a worker that dies while it checks an item, or a reply that is
  not a valid outcome scores that item -1.0 with pred ``[ERROR]`` and a ``reason``, counted in
  ``SandboxPool.errors``; the pool carries on. A worker says it started an item before it checks
  it, so an item sent to a worker that died before reading it is not charged: it goes to a new
  worker, up to ``MAX_ITEM_RETRIES`` times, then scores ``[ERROR]`` saying so.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final

from reward.checking import CheckerSpec, Job, Outcome, outcome_of, spec_json
from reward.result import CORRECT_SCORE, WRONG_SCORE, VerifyResult, error_result
from reward.text import GroundTruthTooLong
from sandbox.pool import MAX_CALL_RETRIES, CallResult, Sandbox, SandboxStartError

logger = logging.getLogger(__name__)

#: Default address-space cap of a worker: 2 GiB.
DEFAULT_MEMORY_LIMIT_BYTES: Final = 2 << 30
#: Times an item goes to a new worker after the one it was sent to died before reading it.
MAX_ITEM_RETRIES: Final = MAX_CALL_RETRIES
TIMEOUT_PRED: Final = "[TIMEOUT]"
#: The longest job sent to a worker, in characters of JSON (a frame holds 1 MiB).
MAX_JOB_CHARS: Final = 256 << 10


class WorkerStartError(SandboxStartError):
    """A worker could not start: its checker could not be loaded, or the sandbox refused it."""


class SandboxPool:
    """Sandbox workers running one checker, with a hard per-item timeout.

    Use as a context manager, or call ``close()``.

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
        read_paths: tuple[str, ...] = (),
    ) -> None:
        """Start ``workers`` sandbox workers, each loading the checker (at once, in parallel).

        Args:
            spec: what each worker loads and how an item becomes a job.
            label: the checker's name in reasons and logs.
            workers: number of worker processes, >= 1.
            timeout_s: hard wall-clock limit per item, seconds, > 0. Start-up time of a worker
                does not count against it.
            memory_limit_bytes: ``RLIMIT_AS`` of each worker; ``None`` for no cap.
            start_timeout_s: how long a worker may take to load the checker.
            read_paths: files the checker reads besides the import path's packages.

        Raises:
            WorkerStartError: a worker could not start (the message says why).
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
        self.timeouts = 0
        self.errors = 0
        self.timeout_result = VerifyResult(
            score=WRONG_SCORE,
            acc=False,
            pred=TIMEOUT_PRED,
            timeout=True,
            reason=f"{label} ran past the {timeout_s:g} s timeout",
        )
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._box = Sandbox(
                "reward.checking:serve",
                factory_args=spec_json(spec),
                workers=workers,
                timeout_s=timeout_s,
                memory_bytes=memory_limit_bytes,
                start_timeout_s=start_timeout_s,
                max_result_chars=64 << 10,
                max_args_chars=MAX_JOB_CHARS,
                read_paths=read_paths,
            )
        except SandboxStartError as exc:
            # The checker's own words ("cannot import math_verify", "has no attribute ...").
            text = str(exc).split("could not be loaded in the sandbox: ", 1)[-1]
            raise WorkerStartError(text.removeprefix("CheckerLoadError: ")) from None

    # -- lifecycle --

    def close(self) -> None:
        """Stop every worker. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._box.close()

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
        return self._box.pids()

    def wait_ready(self) -> None:
        """The workers are ready once the pool is built; kept for callers that wait."""
        if self._closed:
            raise RuntimeError(f"the {self.label} pool is closed")

    # -- scoring --

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
        sources: Sequence[str] | None = None,
    ) -> list[VerifyResult]:
        """``Scorer`` interface: same as ``verify_many`` (``sources`` is not used)."""
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
            RuntimeError: the pool was closed before the call.
            ValueError: ``extra_info`` is not one mapping per pair.
        """
        if self._closed:
            raise RuntimeError(f"the {self.label} pool is closed")
        if extra_info is not None and len(extra_info) != len(pairs):
            raise ValueError(f"{len(extra_info)} extra_info mappings for {len(pairs)} pairs")
        refused: dict[int, VerifyResult] = {}
        jobs: list[str] = []
        for index, (response, truth) in enumerate(pairs):
            extra = dict(extra_info[index]) if extra_info is not None else {}
            try:
                job = self.spec.make_job(response, truth, extra)
            except GroundTruthTooLong as exc:
                refused[index] = error_result(str(exc))
                continue
            jobs.append(_job_text(job))
        checked = iter([self._to_result(r) for r in self._box.call_many(jobs)])
        return [
            refused[index] if index in refused else next(checked) for index in range(len(pairs))
        ]

    def _to_result(self, call: CallResult) -> VerifyResult:
        if call.timed_out:
            self.timeouts += 1
            logger.warning(
                "%s item exceeded %.2f s; its worker was killed", self.label, self.timeout_s
            )
            return self.timeout_result
        if not call.ok:
            self.errors += 1
            reason = call.text.removeprefix("error: ")
            if call.died:
                code = reason.rsplit("(exit code ", 1)[-1].rstrip(")")
                reason = f"the {self.label} worker died while checking this item (exit code {code})"
            else:
                reason = reason.replace("sandbox worker", f"{self.label} worker")
            logger.warning("%s check failed: %s", self.label, reason)
            return error_result(reason[:500])
        try:
            outcome = outcome_of(json.loads(call.text))
        except ValueError as exc:  # JSONDecodeError too: the checked code wrote over the reply
            self.errors += 1
            return error_result(f"the {self.label} worker sent a malformed message ({exc})"[:500])
        return self._scored(outcome)

    def _scored(self, outcome: Outcome) -> VerifyResult:
        if outcome.error is not None:
            self.errors += 1
            logger.warning("%s check failed: %s", self.label, outcome.error)
            return error_result(f"{self.label}: {outcome.error}")
        score = outcome.score
        if score is None:
            score = CORRECT_SCORE if outcome.acc else WRONG_SCORE
        return VerifyResult(
            score=score, acc=outcome.acc, pred=outcome.pred, metrics=outcome.metrics
        )


def _job_text(job: Job) -> str:
    return json.dumps(
        {"response": job.response, "ground_truth": job.ground_truth, "extra_info": job.extra_info},
        default=str,  # extra_info is the user's row: a date or a numpy value travels as text
    )
