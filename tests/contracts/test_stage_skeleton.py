"""The stage skeleton (`contracts.runtime.serve_stage`) and its one error policy, against a real
Redis: a handler that fails once has its entries redone, a handler that keeps failing ends the
process's loop (so its supervisor replaces it) after writing its final stats, and a stage's
heartbeat lives exactly as long as its loop."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.bus import Entry, StreamBus, connect
from contracts.config import QueueConfig
from contracts.keys import Keys
from contracts.runtime import (
    ServiceContext,
    StageFailing,
    StageLoop,
    StopFlag,
    run_stage_loop,
    serve_stage,
)
from tests.contracts.test_streams import issue


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("skeleton"), consumer="stage-1")
    b.ensure_groups()
    return b


QUEUE = QueueConfig(block_ms=20, max_deliveries=3)


class FlakyWorker:
    """Fails its first `failures` batches, then hops every entry downstream."""

    def __init__(self, bus: StreamBus, stop: StopFlag, failures: int, batch: int = 4) -> None:
        self.bus, self.stop, self.failures, self.batch = bus, stop, failures, batch
        self.attempts, self.done, self.closed = 0, 0, False

    @property
    def loop(self) -> StageLoop:
        return StageLoop(self.bus.keys.prompts, batch=self.batch, reclaim_every_s=0.0)

    def handle(self, entries: list[Entry]) -> None:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise RuntimeError("handler bug")
        for entry_id, _ in entries:
            self.done += self.bus.hop(
                self.bus.keys.prompts,
                entry_id,
                downstream=self.bus.keys.rollouts.stream,
                fields={"ok": b"1"},
            )
        if self.done == 2:
            self.stop.event.set()

    def status(self) -> dict[str, Any]:
        return {"done": self.done, "attempts": self.attempts}

    def close(self) -> None:
        self.closed = True


def test_a_batch_whose_handler_failed_is_redone(
    bus: StreamBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StopFlag, "wait", lambda self, seconds: self.event.wait(0.01))
    issue(bus, 2)
    stop = StopFlag()
    worker = FlakyWorker(bus, stop, failures=1)
    serve_stage(ServiceContext("stage", "stage-1", bus, stop), worker, QUEUE)
    assert (worker.done, worker.attempts, worker.closed) == (2, 2, True)
    assert bus.redis.xlen(bus.keys.rollouts.stream) == 2
    assert bus.final_stats("stage") == {"stage-1": {"done": 2, "attempts": 2}}
    assert bus.live_instances("stage") == []  # the heartbeat went with the loop


def test_a_handler_that_keeps_failing_ends_the_stage_after_its_final_stats(
    bus: StreamBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every batch fails, each a different entry: the worker is broken, not one entry (a single
    poison entry would be dead-lettered after `max_deliveries` and the stage would go on)."""
    monkeypatch.setattr(StopFlag, "wait", lambda self, seconds: self.event.wait(0.01))
    issue(bus, 6)
    stop = StopFlag()
    worker = FlakyWorker(bus, stop, failures=100, batch=1)
    with pytest.raises(StageFailing, match="4 rounds in a row failed"):
        serve_stage(ServiceContext("stage", "stage-1", bus, stop), worker, QUEUE)
    assert worker.attempts == QUEUE.max_deliveries + 1 and worker.closed
    assert bus.final_stats("stage")["stage-1"]["done"] == 0
    assert bus.live_instances("stage") == []
    # Nothing was lost: the failed entries are still pending, for another worker to reclaim.
    assert bus.redis.xpending(bus.keys.prompts.stream, bus.keys.prompts.group)["pending"] == 4
    assert bus.ledger().balanced


def test_the_loop_stops_when_asked_between_batches(bus: StreamBus) -> None:
    stop, seen = StopFlag(), []

    def handle(entries: list[Entry]) -> None:
        seen.extend(entries)
        stop.event.set()

    issue(bus, 1)
    issue(bus, 1)  # a second job waits: the loop must not take it after the stop
    run_stage_loop(bus, StageLoop(bus.keys.prompts), handle, queue=QUEUE, stop=stop)
    assert len(seen) == 1
    assert bus.redis.xlen(bus.keys.prompts.stream) == 2  # the handler hopped nothing; both wait
