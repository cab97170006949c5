"""Where a restarted learner continues issuing prompts: group ids are the data cursor, so a
cursor that went back would issue, and train, groups a second time. Against a real Redis."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from contracts.bus import StreamBus, connect
from contracts.keys import LEDGER_ISSUED, Counter, Keys, RunField
from learner.collect import StreamSource


def resumed(bus: StreamBus, checkpoint_cursor: int, *, skipping: bool = False) -> SimpleNamespace:
    source = StreamSource.__new__(StreamSource)  # only what resume() touches
    feeder = SimpleNamespace(cursor=0, jobs_issued=0, skip=object() if skipping else None)
    source.transport, source.run_state, source.feeder = bus, bus, feeder
    source.resume(checkpoint_cursor)
    return feeder


def resumed_cursor(bus: StreamBus, checkpoint_cursor: int) -> int:
    return int(resumed(bus, checkpoint_cursor).cursor)


@pytest.mark.parametrize(
    ("checkpoint", "recorded", "issued", "expected"),
    [
        (20, b"40", 40, 40),  # Redis recorded a later cursor than the checkpoint
        (50, b"40", 40, 50),  # a --resume onto a Redis that knows less
        (20, b"36", 40, 40),  # died between issuing and recording the cursor: the ledger knows
        (20, b"twelve", 40, 40),  # a planted cursor: skipped and counted, the ledger knows
        (20, None, 0, 20),  # a fresh Redis: the checkpoint
    ],
)
def test_a_restarted_learner_never_issues_a_group_id_twice(
    redis_url: str, checkpoint: int, recorded: bytes | None, issued: int, expected: int
) -> None:
    bus = StreamBus(connect(redis_url), Keys("resume"), consumer="c")
    if recorded is not None:
        bus.redis.hset(bus.keys.run_info, str(RunField.DATA_CURSOR), recorded)
    if issued:
        bus.redis.hset(bus.keys.ledger, LEDGER_ISSUED, issued)
    assert resumed_cursor(bus, checkpoint) == expected
    bad = int(bus.redis.hget(bus.keys.counters, Counter.BAD_REDIS_VALUES) or 0)
    assert bad == (1 if recorded == b"twelve" else 0)


def test_with_skipping_the_recorded_cursor_leads_and_the_budget_counts_the_ledger(
    redis_url: str,
) -> None:
    """Skipped prompts move the cursor past the ledger's issued count: the feeder records its
    cursor before issuing, and a restart continues from it; the budget counts issued jobs."""
    bus = StreamBus(connect(redis_url), Keys("resume-skip"), consumer="c")
    bus.redis.hset(bus.keys.run_info, str(RunField.DATA_CURSOR), b"60")
    bus.redis.hset(bus.keys.ledger, LEDGER_ISSUED, 30)
    feeder = resumed(bus, 20, skipping=True)
    assert (feeder.cursor, feeder.jobs_issued) == (60, 30)
    # Without skipping every position was issued: the checkpoint bounds the budget too.
    bus.redis.delete(bus.keys.ledger, bus.keys.run_info)
    assert resumed(bus, 20).jobs_issued == 20
