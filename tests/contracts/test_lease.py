"""The learner lease against a real Redis: one holder at a time, a second learner told who holds
it, every write of a superseded learner refused inside Redis (nothing written), a vacant lease
taken back by its holder, renewal outliving the TTL, and a clean release."""

from __future__ import annotations

import time

import pytest

from contracts.bus import FencedError, StreamBus, connect
from contracts.keys import Counter, Keys, RunField
from contracts.lease import LearnerLease, LeaseHeldError


def new_bus(url: str, name: str) -> StreamBus:
    bus = StreamBus(connect(url), Keys("lease-test"), consumer=name)
    bus.ensure_groups()
    return bus


def test_a_second_learner_is_told_who_holds_the_lease(redis_url: str) -> None:
    first = LearnerLease(new_bus(redis_url, "a"), holder="learner-a", ttl_s=5.0)
    first.acquire(wait_s=0)
    second = LearnerLease(new_bus(redis_url, "b"), holder="learner-b", ttl_s=5.0)
    start = time.monotonic()
    with pytest.raises(
        LeaseHeldError, match=r"another learner holds the learner lease \(\d+:learner-a\)"
    ):
        second.acquire(wait_s=0.5)
    assert time.monotonic() - start >= 0.5  # it waited before giving up
    first.release()
    assert second.acquire(wait_s=0)  # released: taken at once
    second.release()


def test_every_write_of_a_superseded_learner_is_refused_and_writes_nothing(redis_url: str) -> None:
    old_bus = new_bus(redis_url, "old")
    old = LearnerLease(old_bus, holder="learner-old", ttl_s=0.5)
    old.acquire(wait_s=0)
    old._stop.set()  # paused: it stops renewing and does not know it yet
    old_bus.issue([{"group_id": b"g0", "prompt": b"x"}])
    entry = old_bus.read(old_bus.keys.prompts, count=1, block_ms=None)[0][0]
    before = (old_bus.ledger(), old_bus.counters(), old_bus.redis.xlen(old_bus.keys.prompts.stream))
    time.sleep(0.7)
    new = LearnerLease(new_bus(redis_url, "new"), holder="learner-new", ttl_s=30.0)
    new.acquire(wait_s=5)  # the old lease expired: taken over
    writes = {
        "issue": lambda: old_bus.issue([{"group_id": b"g1", "prompt": b"y"}]),
        "hop": lambda: old_bus.hop(old_bus.keys.prompts, entry, outcome="trained"),
        "count": lambda: old_bus.incr(Counter.TRAINED_TWICE),
        "policy version": lambda: old_bus.set_policy_version(99),
        "learner state": lambda: old_bus.set_learner_state("training", step=5, policy_version=99),
        "run info": lambda: old_bus.update_run_info({RunField.DATA_CURSOR: 7}),
        "trained id": lambda: old_bus.mark_trained_id("g0"),
        "metrics": lambda: old_bus.append_metrics({"step": 5}),
    }
    for name, write in writes.items():
        with pytest.raises(FencedError, match="superseded"):
            write()
        assert (
            old_bus.ledger(),
            old_bus.counters(),
            old_bus.redis.xlen(old_bus.keys.prompts.stream),
        ) == before, name
    assert old_bus.policy_version() == 0 and old_bus.run_field(RunField.DATA_CURSOR) is None
    with pytest.raises(FencedError):
        old.check()  # the checkpoint guard agrees
    new.check()
    new.bus.set_policy_version(1)  # the holder writes as before
    assert new.bus.policy_version() == 1
    new.release()


def test_a_vacant_lease_is_taken_back_by_its_holder(redis_url: str) -> None:
    bus = new_bus(redis_url, "a")
    lease = LearnerLease(bus, holder="learner-a", ttl_s=30.0)
    token = lease.acquire(wait_s=0)
    bus.redis.delete(bus.keys.learner_lease)  # Redis lost its data (restart without AOF)
    bus.set_policy_version(3)  # nobody else wrote meanwhile: the write goes through ...
    assert bus.redis.get(bus.keys.learner_lease) == token.encode()  # ... and holds the lease again
    with pytest.raises(LeaseHeldError):
        LearnerLease(new_bus(redis_url, "b"), holder="learner-b", ttl_s=30.0).acquire(wait_s=0)
    lease.release()


def test_the_renewer_keeps_the_lease_past_its_ttl(redis_url: str) -> None:
    bus = new_bus(redis_url, "a")
    lease = LearnerLease(bus, holder="learner-a", ttl_s=0.3)
    lease.acquire(wait_s=0)
    time.sleep(1.2)  # four TTLs
    lease.check()
    bus.incr(Counter.TRAINED_TWICE)
    assert not lease.lost.is_set()
    lease.release()
    assert bus.redis.get(bus.keys.learner_lease) is None
