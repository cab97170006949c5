"""Rank 0's run control against a real Redis: its lease check (the guard the loop runs before
every checkpoint) refuses once another learner holds the learner lease."""

from __future__ import annotations

import pytest

from contracts.bus import FencedError, StreamBus, connect
from contracts.keys import Keys
from contracts.lease import LearnerLease
from learner.control import RunControl


def new_bus(url: str, name: str) -> StreamBus:
    bus = StreamBus(connect(url), Keys("control-test"), consumer=name)
    bus.ensure_groups()
    return bus


def test_check_lease_refuses_once_another_learner_holds_the_lease(redis_url: str) -> None:
    bus = new_bus(redis_url, "learner-a")
    lease = LearnerLease(bus, holder="learner-a", ttl_s=30.0)
    lease.acquire(wait_s=0)
    control = RunControl(
        run_state=bus,
        telemetry=bus,
        run_name="run",
        instance="learner-a",
        heartbeat_ttl_s=5.0,
        lease=lease,
    )
    control.check_lease()  # held: the checkpoint may be written

    # learner-a was paused past its TTL (the key expired) and learner-b took over meanwhile.
    bus.redis.delete(bus.keys.learner_lease)
    successor = LearnerLease(new_bus(redis_url, "learner-b"), holder="learner-b", ttl_s=30.0)
    token = successor.acquire(wait_s=0)
    with pytest.raises(
        FencedError, match=r"no longer holds the learner lease \(now \d+:learner-b\)"
    ):
        control.check_lease()
    with pytest.raises(FencedError):
        control.check_lease()  # and stays refused: the lease is not taken back from a holder
    control.close()  # a superseded learner's exit leaves the successor's lease alone
    assert bus.redis.get(bus.keys.learner_lease) == token.encode()
    successor.check()
    successor.release()
