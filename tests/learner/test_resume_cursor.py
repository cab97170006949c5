"""Where a restarted learner continues issuing prompts: group ids are the data cursor, so a
cursor that went back would issue, and train, groups a second time. Against a real Redis."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from learner.collect import StreamSource
from services.contracts.bus import StreamBus, connect
from services.contracts.keys import LEDGER_DAMAGED, LEDGER_ISSUED, Counter, Keys, RunField

ADMISSION_LIMIT = 8


def resumed_cursor(bus: StreamBus, checkpoint_cursor: int) -> int:
    source = StreamSource.__new__(StreamSource)  # only what resume() touches
    source.bus, source.feeder = bus, SimpleNamespace(cursor=0, limit=ADMISSION_LIMIT)
    source.resume(checkpoint_cursor)
    return int(source.feeder.cursor)


@pytest.mark.parametrize(
    ("checkpoint", "recorded", "issued", "expected"),
    [
        (20, b"40", 40, 40),  # Redis recorded a later cursor than the checkpoint
        (50, b"40", 40, 50),  # a --resume onto a Redis that knows less
        (20, b"36", 40, 40),  # died between issuing and recording the cursor: the ledger knows
        (20, b"twelve", 40, 40),  # a planted cursor: skipped and counted, the ledger knows
        (20, None, 0, 20),  # a fresh Redis: the checkpoint
        (20, b"48", 40, 48),  # one admission built, its issue refused: prompts skipped, never repeated
        (20, b"1000000", 40, 40),  # a planted cursor that parses: past any admission, skipped and counted
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
    assert bad == (1 if recorded in (b"twelve", b"1000000") else 0)


def test_after_redis_lost_the_run_the_recorded_cursor_is_trusted_past_the_ledger(redis_url: str) -> None:
    """The ledger restarted from zero when Redis lost the run (the learner recorded when, and
    its cursor again): the cursor is then far ahead of the ledger's count, legitimately."""
    bus = StreamBus(connect(redis_url), Keys("resume-lost"), consumer="c")
    bus.update_run_info({RunField.DATA_CURSOR: 1000, RunField.REDIS_DATA_LOST_AT: 1.5})
    bus.redis.hset(bus.keys.ledger, LEDGER_ISSUED, 5)
    assert resumed_cursor(bus, 20) == 1000


def test_with_a_damaged_ledger_the_recorded_cursor_is_trusted(redis_url: str) -> None:
    bus = StreamBus(connect(redis_url), Keys("resume-damaged"), consumer="c")
    bus.update_run_info({RunField.DATA_CURSOR: 1000})
    bus.redis.hset(bus.keys.ledger, mapping={LEDGER_ISSUED: 5, LEDGER_DAMAGED: 1})
    assert resumed_cursor(bus, 20) == 1000
