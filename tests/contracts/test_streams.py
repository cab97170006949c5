"""The stream transport against a real Redis: hops are atomic and exactly-once, reclaim and
dead letters work, the ledger balances, a stage worker keeps the claims of work that outlasts
the claim timeout, and takes over a dead consumer's work without waiting for that timeout."""

from __future__ import annotations

import threading
import time

import pytest

from contracts.bus import GONE_AFTER_TTLS, Entry, StreamBus, connect
from contracts.config import QueueConfig
from contracts.keys import Keys
from contracts.runtime import Heartbeat, StageLoop, StopFlag, instance_id, run_stage_loop
from contracts.schemas import decode_scored_group, encode_group, encode_job
from gatekeeper.service import Gatekeeper, keep_group
from tests.contracts.test_schemas import make_group
from tests.helpers import judged, wait_for


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("t"), consumer="c1")
    b.ensure_groups()
    return b


def issue(bus: StreamBus, n: int) -> None:
    jobs = []
    for i in range(n):
        job = make_group().job.model_copy(update={"group_id": f"g{i}", "prompt_index": i})
        jobs.append(encode_job(job))
    assert bus.issue(jobs) == n


def test_issue_and_ledger_balance(bus: StreamBus) -> None:
    issue(bus, 5)
    snap = bus.ledger()
    assert (snap.issued, snap.in_flight, snap.balanced) == (5, 5, True)


def test_hop_is_exactly_once(bus: StreamBus) -> None:
    issue(bus, 1)
    [(eid, _)] = bus.read(bus.keys.prompts, count=10, block_ms=10)
    group = make_group()
    assert bus.hop(
        bus.keys.prompts, eid, downstream=bus.keys.rollouts.stream, fields=encode_group(group)
    )
    # A second worker that had reclaimed the same entry finishes late: nothing is written.
    assert not bus.hop(
        bus.keys.prompts, eid, downstream=bus.keys.rollouts.stream, fields=encode_group(group)
    )
    assert bus.depths() == {
        "rollout": 0,
        "reward": 1,
        "gatekeeper": 0,
        "learner": 0,
        "evaluation": 0,
    }
    assert bus.ledger().balanced


def test_reclaim_from_dead_consumer_then_dead_letter(bus: StreamBus, redis_url: str) -> None:
    issue(bus, 1)
    dead_worker = StreamBus(connect(redis_url), bus.keys, consumer="dead")
    assert len(dead_worker.read(bus.keys.prompts, count=1, block_ms=10)) == 1  # then "dies"
    assert bus.read(bus.keys.prompts, count=1, block_ms=10) == []
    time.sleep(0.06)
    got = bus.reclaim(bus.keys.prompts, min_idle_s=0.05, max_deliveries=3)
    assert len(got) == 1
    # Keep failing: after max_deliveries the entry is dead-lettered, counted,
    # and the ledger balances.
    for _ in range(3):
        time.sleep(0.06)
        got = bus.reclaim(bus.keys.prompts, min_idle_s=0.05, max_deliveries=3)
    snap = bus.ledger()
    assert (snap.dead, snap.in_flight, snap.balanced) == (1, 0, True)
    [(_, record)] = bus.redis.xrange(bus.keys.dead)
    assert b"delivered 3 times" in record[b"reason"] and record[b"group_id"] == b"g0"


def test_poison_message_is_dead_lettered_not_counted_as_issued(bus: StreamBus) -> None:
    bus.redis.xadd(bus.keys.scored.stream, {"junk": b"\xff\x00"})
    gate = Gatekeeper(bus)
    gate.handle(bus.read(bus.keys.scored, count=10, block_ms=10))
    assert bus.redis.xlen(bus.keys.dead) == 1
    assert bus.redis.hget(bus.keys.counters, "poison_messages") == b"1"
    assert bus.ledger().as_dict()["dead"] == 0


def test_gatekeeper_routes_and_counts(bus: StreamBus) -> None:
    issue(bus, 2)
    entries = bus.read(bus.keys.prompts, count=10, block_ms=10)
    for (eid, _), accs in zip(entries, [[True, False, True, True], [True] * 4], strict=True):
        g = make_group()
        g.job.group_id = f"gid-{eid}"
        if all(accs):  # the group the gatekeeper filters had one response cut at the length limit
            g.responses[0].finish_reason = "length"
        fields = encode_group(judged(g, accs))
        bus.hop(bus.keys.prompts, eid, downstream=bus.keys.scored.stream, fields=fields)
    gate = Gatekeeper(bus)
    gate.handle(bus.read(bus.keys.scored, count=10, block_ms=10))
    assert (gate.kept, gate.filtered, gate.pass_rate) == (1, 1, 0.5)
    # Responses are counted for the truncation rate whether their group was kept or filtered.
    assert (bus.counters()["responses_judged"], bus.counters()["responses_truncated"]) == (8, 1)
    [(_, fields)] = bus.redis.xrange(bus.keys.train.stream)
    assert decode_scored_group(fields).acc == [True, False, True, True]
    snap = bus.ledger()
    assert (snap.filtered, snap.in_flight, snap.balanced) == (1, 1, True)


@pytest.mark.parametrize(
    ("values", "kept"),
    [
        ([1.0], True),
        ([True, True], False),
        ([False, False, False], False),
        ([1, 0], True),
        ([float("nan"), 1.0, 1.0], False),
        ([float("nan"), float("nan")], False),
        ([float("nan"), 0.0, 1.0], True),
    ],
)
def test_keep_group(values: list[float], kept: bool) -> None:
    assert keep_group(values) is kept


def test_a_delivery_whose_reply_was_lost_is_redone_by_its_own_consumer_at_once(
    bus: StreamBus,
) -> None:
    """A read whose reply never arrived (the connection dropped and the client retried) leaves
    the entry pending under this consumer's name; the next reclaim takes it back within about a
    second instead of waiting out claim_idle_s (300 s) for another consumer."""
    issue(bus, 1)
    assert len(bus.read(bus.keys.prompts, count=1, block_ms=10)) == 1  # the reply is "lost"
    assert bus.reclaim(bus.keys.prompts, min_idle_s=300, max_deliveries=3) == []  # too fresh yet
    time.sleep(1.1)
    [(_, fields)] = bus.reclaim(bus.keys.prompts, min_idle_s=300, max_deliveries=3)
    assert fields[b"group_id"] == b"g0"


def test_a_stage_worker_keeps_the_claim_on_work_that_outlasts_the_claim_timeout(
    bus: StreamBus,
) -> None:
    """`run_stage_loop` renews the claims of the entries its handler holds: while one worker's
    handler works for three claim timeouts, another worker reclaiming every 50 ms takes nothing
    over, and the entry is processed once."""
    issue(bus, 1)
    stage, queue = bus.keys.prompts, QueueConfig(claim_idle_s=0.5, block_ms=50)
    [(raw_id, _)] = bus.redis.xrange(stage.stream)
    handled: list[tuple[str, str]] = []
    working, stop = threading.Event(), StopFlag()

    def stage_worker(name: str) -> threading.Thread:
        consumer = bus.as_consumer(name)

        def handle(entries: list[Entry]) -> None:
            handled.extend((name, entry_id) for entry_id, _ in entries)
            working.set()
            time.sleep(1.5)  # a long batch: three claim timeouts
            for entry_id, _ in entries:
                consumer.hop(
                    stage,
                    entry_id,
                    downstream=bus.keys.rollouts.stream,
                    fields={"done_by": name.encode()},
                )

        thread = threading.Thread(
            target=run_stage_loop,
            args=(consumer, StageLoop(stage, reclaim_every_s=0.05), handle),
            daemon=True,
            kwargs={"queue": queue, "stop": stop},
        )
        thread.start()
        return thread

    workers = [stage_worker("slow")]
    assert working.wait(10)
    workers.append(stage_worker("reclaimer"))  # starts while the slow one works, reclaiming at once
    try:
        wait_for(
            "the slow worker's hop",
            lambda: bus.redis.xlen(bus.keys.rollouts.stream),
            timeout_s=10,
            every_s=0.05,
        )
        time.sleep(0.3)  # the reclaimer keeps looking after the hop: nothing is left to take
    finally:
        stop.event.set()
        for thread in workers:
            thread.join(timeout=10)
    assert handled == [("slow", raw_id.decode())]
    assert [fields[b"done_by"] for _, fields in bus.redis.xrange(bus.keys.rollouts.stream)] == [
        b"slow"
    ]
    assert bus.redis.xpending(stage.stream, stage.group)["pending"] == 0
    assert not any(t.is_alive() for t in workers)


def test_a_consumer_name_leads_to_its_heartbeat() -> None:
    keys, inst = Keys("t"), instance_id("rollout")
    assert keys.consumer_heartbeat(inst) == keys.heartbeat("rollout", inst)
    with pytest.raises(ValueError, match="cannot contain"):
        instance_id("roll-out")


def test_a_stage_takes_over_a_dead_consumers_entry_before_the_claim_timeout(bus: StreamBus) -> None:
    """A consumer that read an entry and was killed (the supervisor dropped its heartbeat) loses
    it to a live stage once it sat GONE_AFTER_TTLS heartbeat TTLs, not after claim_idle_s
    (300 s); a consumer whose heartbeat is present keeps its entry for as long, and a freshly
    read entry is not taken at once even though its consumer's heartbeat is gone."""
    issue(bus, 2)
    ttl_s, stage = 0.5, bus.keys.prompts
    queue = QueueConfig(claim_idle_s=300, heartbeat_ttl_s=ttl_s, block_ms=50)
    dead_name, live_name = "rollout-host-1", "rollout-host-2"  # as `instance_id` names them
    beats = {
        name: Heartbeat(bus, "rollout", name, ttl_s).start() for name in (dead_name, live_name)
    }
    [(dead_id, _)] = bus.as_consumer(dead_name).read(stage, count=1, block_ms=None)
    [(live_id, _)] = bus.as_consumer(live_name).read(stage, count=1, block_ms=None)
    beats[dead_name].stop()
    bus.drop_heartbeat("rollout", dead_name)  # what `dapo run` does when it sees a process die
    taker = bus.as_consumer("rollout-host-3")
    assert taker.reclaim(stage, min_idle_s=300, max_deliveries=3, heartbeat_ttl_s=ttl_s) == []

    handled: list[str] = []
    stop = StopFlag()

    def handle(entries: list[Entry]) -> None:
        for entry_id, _ in entries:
            handled.append(entry_id)
            taker.hop(stage, entry_id, downstream=bus.keys.rollouts.stream, fields={"by": b"taker"})

    beats[taker.consumer] = Heartbeat(taker, "rollout", taker.consumer, ttl_s).start()
    thread = threading.Thread(
        target=run_stage_loop,
        args=(taker, StageLoop(stage, reclaim_every_s=0.05), handle),
        daemon=True,
        kwargs={"queue": queue, "stop": stop},
    )
    started = time.monotonic()
    thread.start()
    try:
        wait_for(
            "the dead consumer's entry taken over", lambda: handled, timeout_s=30, every_s=0.05
        )
        took_s = time.monotonic() - started
        time.sleep(3 * GONE_AFTER_TTLS * ttl_s)  # the live consumer's entry is as idle by now
    finally:
        stop.event.set()
        thread.join(timeout=10)
        for beat in beats.values():
            beat.stop()
    assert handled == [dead_id], handled
    assert took_s < 10  # claim_idle_s is 300
    [pending] = bus.redis.xpending_range(stage.stream, stage.group, min="-", max="+", count=10)
    assert (pending["message_id"].decode(), pending["consumer"]) == (live_id, live_name.encode())
    assert pending["time_since_delivered"] >= 2 * GONE_AFTER_TTLS * ttl_s * 1000
