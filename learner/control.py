"""Rank 0's run state in Redis: heartbeat, learner state, policy version, run info, operator
requests, and the detection of Redis having lost the run. Other ranks hold `NullControl`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from contracts.bus import RunState, Telemetry
from contracts.keys import Counter, RunField
from contracts.lease import LearnerLease
from contracts.runtime import Heartbeat
from contracts.schemas import CheckpointRequest, PauseRequest, RestoreRequest
from learner.commands import Command, Pause, Progress, Restore, SaveCheckpoint

log = logging.getLogger(__name__)

RunInfo = Mapping[RunField, str | int | float]


class Control(Protocol):
    def start(self, status: Callable[[], dict[str, Any]]) -> None: ...

    def announce(self, state: str, progress: Progress) -> None: ...

    def published_policy_version(self) -> int: ...

    def set_policy_version(self, progress: Progress) -> None: ...

    def take_request(self) -> Command | None: ...

    def lost_run_state(self, progress: Progress) -> bool: ...

    def record(self, fields: RunInfo) -> None: ...

    def count(self, counter: Counter) -> None: ...

    def check_lease(self) -> None: ...

    def close(self) -> None: ...


class NullControl:
    """Ranks other than 0: no Redis."""

    def start(self, status: Callable[[], dict[str, Any]]) -> None:
        pass

    def announce(self, state: str, progress: Progress) -> None:
        pass

    def published_policy_version(self) -> int:
        return 0

    def set_policy_version(self, progress: Progress) -> None:
        pass

    def take_request(self) -> Command | None:
        return None

    def lost_run_state(self, progress: Progress) -> bool:
        return False

    def record(self, fields: RunInfo) -> None:
        pass

    def count(self, counter: Counter) -> None:
        pass

    def check_lease(self) -> None:
        pass

    def close(self) -> None:
        pass


class RunControl:
    """Rank 0: the learner's face in Redis."""

    def __init__(
        self,
        *,
        run_state: RunState,
        telemetry: Telemetry,
        run_name: str,
        instance: str,
        heartbeat_ttl_s: float,
        lease: LearnerLease | None = None,
    ) -> None:
        # The parts of the bus it touches: `run_state` (state, policy version, run info, control
        # requests) and `telemetry` (its heartbeat, counters).
        self.run_state, self.telemetry = run_state, telemetry
        self.run_name, self.instance, self.lease = run_name, instance, lease
        self._status: Callable[[], dict[str, Any]] = dict
        self.heartbeat = Heartbeat(
            telemetry, "learner", instance, heartbeat_ttl_s, lambda: self._status()
        )

    def start(self, status: Callable[[], dict[str, Any]]) -> None:
        """Heartbeat with `status()` (state, step, policy_version), and the marker whose absence
        later means Redis lost the run's state."""
        self._status = status
        self.heartbeat.start()
        self.run_state.update_run_info(
            {RunField.RUN_NAME: self.run_name, RunField.ALIVE_MARKER: self.instance}
        )

    def announce(self, state: str, progress: Progress) -> None:
        self.run_state.set_learner_state(
            state, step=progress.step, policy_version=progress.policy_version
        )

    def published_policy_version(self) -> int:
        return self.run_state.policy_version()

    def set_policy_version(self, progress: Progress) -> None:
        self.run_state.set_policy_version(progress.policy_version)

    def take_request(self) -> Command | None:
        """The operator request to carry out now: restore, then checkpoint (both taken once),
        then pause (stays set until POST /resume removes it)."""
        requests = self.run_state.control_requests()
        restore, checkpoint = requests.get("restore"), requests.get("checkpoint")
        if isinstance(restore, RestoreRequest):
            self.run_state.clear_control(restore.kind)
            return Restore(restore.step)
        if isinstance(checkpoint, CheckpointRequest):
            self.run_state.clear_control(checkpoint.kind)
            return SaveCheckpoint(keep=checkpoint.keep)
        if isinstance(requests.get("pause"), PauseRequest):
            return Pause()
        return None

    def lost_run_state(self, progress: Progress) -> bool:
        """Detect Redis having lost the run's state (restarted without AOF, or flushed): the
        marker written at start is gone. The loss is recorded in run info and the counters, never
        hidden; the queued work is gone with it, and the ledger restarts from zero."""
        if self.run_state.run_field(RunField.ALIVE_MARKER) is not None:
            return False
        log.error(
            "Redis lost the run's state (queued groups and ledger are gone); continuing "
            "from step %d",
            progress.step,
        )
        self.run_state.ensure_groups()
        self.run_state.update_run_info(
            {
                RunField.RUN_NAME: self.run_name,
                RunField.ALIVE_MARKER: self.instance,
                RunField.REDIS_DATA_LOST_AT: time.time(),
            }
        )
        self.run_state.set_policy_version(progress.policy_version)
        self.telemetry.incr(Counter.REDIS_DATA_LOSS)
        return True

    def record(self, fields: RunInfo) -> None:
        self.run_state.update_run_info(fields)

    def count(self, counter: Counter) -> None:
        self.telemetry.incr(counter)

    def check_lease(self) -> None:
        """Raise `FencedError` when another learner holds the lease (before a checkpoint: the
        store cannot check a token the way Redis does)."""
        if self.lease is not None:
            self.lease.check()

    def close(self) -> None:
        self.heartbeat.stop()
        if self.lease is not None:
            self.lease.release()
