"""Keys of the wrong type in Redis (a string where the services keep a hash, a hash where they
keep a string): planted, or left by another program sharing the server. Readers skip them and
count a bad value, as they do for a value that does not parse; a service that writes such a
key replaces it (also under the learner's fence), so one planted key neither crashes a
service nor blocks its writes for good."""

from __future__ import annotations

import json
import time

import pytest

from contracts.bus import StreamBus, connect
from contracts.keys import Counter, Keys, RunField


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("typed"), consumer="c")
    b.ensure_groups()
    return b


def bad_values(bus: StreamBus) -> int:
    return int(bus.redis.hget(bus.keys.counters, Counter.BAD_REDIS_VALUES) or 0)


def test_readers_skip_a_key_of_the_wrong_type_and_count_it(bus: StreamBus) -> None:
    k, r = bus.keys, bus.redis
    r.hset(k.policy_version, "x", "1")  # a hash where the learner keeps a string
    r.set(k.learner_state, "garbage")
    r.set(k.run_info, "garbage")
    r.rpush(k.heartbeat("rollout", "listed"), "x")  # a list among the heartbeats
    r.set(
        k.heartbeat("rollout", "r0"),
        json.dumps({"id": "r0", "at": time.time(), "policy_version": 3}),
    )
    r.set(k.final_stats("rollout", "typed"), "garbage")
    assert bus.policy_version() == 0
    assert bus.learner_state() == {}
    assert bus.run_info() == {} and bus.run_field(RunField.DATA_CURSOR) is None
    assert bus.eval_history() == []
    assert [i["id"] for i in bus.live_instances("rollout")] == ["r0"]
    assert bus.final_stats("rollout") == {}
    assert (
        bad_values(bus) == 5
    )  # policy version, learner state, run info, the listed heartbeat, the final stats


def test_counters_of_the_wrong_type_read_as_none(bus: StreamBus) -> None:
    bus.redis.set(bus.keys.counters, "garbage")
    assert bus.counters() == {}
    assert bus.pass_rate(filtered=2) == 0.0  # nothing kept that can be read: 0 of 2


def test_a_counter_of_the_wrong_type_is_replaced_and_keeps_its_own_count(bus: StreamBus) -> None:
    """Counting the bad value writes to the very hash being replaced: the count must survive."""
    bus.redis.set(bus.keys.counters, "garbage")
    bus.incr(Counter.GATEKEEPER_KEPT, 3)
    assert bus.counters() == {Counter.GATEKEEPER_KEPT: 3, Counter.BAD_REDIS_VALUES: 1}


def test_a_control_key_of_the_wrong_type_is_removed_and_requests_flow_again(bus: StreamBus) -> None:
    from contracts.schemas import PauseRequest

    bus.redis.sadd(bus.keys.control, "restore")
    assert bus.control_requests() == {}
    assert not bus.redis.exists(bus.keys.control) and bad_values(bus) == 1
    bus.post_control(PauseRequest())
    assert set(bus.control_requests()) == {"pause"}


def test_an_oversized_control_request_is_dropped_after_one_bounded_parse(bus: StreamBus) -> None:
    """A request planted with the API's password, megabytes of valid JSON: refused on its size
    before parsing, removed, counted, and the next poll does not meet it again."""
    from contracts.schemas import PauseRequest

    huge = json.dumps({"kind": "pause", "note": "x" * 2_000_000})
    bus.redis.hset(bus.keys.control, "pause", huge)
    started = time.monotonic()
    assert bus.control_requests() == {}
    assert time.monotonic() - started < 0.5
    assert not bus.redis.hexists(bus.keys.control, "pause")
    assert int(bus.redis.hget(bus.keys.counters, Counter.BAD_CONTROL_REQUESTS) or 0) == 1
    bus.post_control(PauseRequest())
    assert set(bus.control_requests()) == {"pause"}


@pytest.mark.parametrize("fenced", [False, True])
def test_a_writer_replaces_a_key_of_the_wrong_type(bus: StreamBus, fenced: bool) -> None:
    if fenced:  # the learner writes under its lease: the replacement goes through the fence too
        bus.redis.set(bus.keys.learner_lease, "token-1")
        bus.hold_fence("token-1", ttl_s=30)
    bus.redis.set(bus.keys.learner_state, "garbage")
    bus.redis.rpush(bus.keys.run_info, "garbage")
    bus.redis.hset(bus.keys.policy_version, "x", "1")
    bus.set_learner_state("training", step=7, policy_version=7)
    bus.update_run_info({RunField.DATA_CURSOR: 42})
    bus.set_policy_version(7)
    assert bus.learner_state()["step"] == "7"
    assert bus.run_field(RunField.DATA_CURSOR) == "42"
    assert bus.policy_version() == 7
    assert (
        bad_values(bus) == 2
    )  # learner state and run info were replaced; SET overwrites any type anyway


# --- the ledger: counted inside the scripts that move work, read by every service -----------------
def issue_and_hop_one(bus: StreamBus) -> None:
    """Issue one training job and move it from the prompts stream to the next stage, counting
    nothing (what a rollout replica does with it)."""
    assert bus.issue([{"job": b"1"}]) == 1
    [(entry_id, _)] = bus.read(bus.keys.prompts, count=1, block_ms=None)
    assert bus.hop(
        bus.keys.prompts, entry_id, downstream=bus.keys.rollouts.stream, fields={"x": b"1"}
    )


def test_a_ledger_of_the_wrong_type_reads_as_empty_and_is_replaced_by_the_next_count(
    bus: StreamBus,
) -> None:
    bus.redis.set(bus.keys.ledger, "garbage")
    assert bus.ledger().damaged and bus.ledger().issued == 0 and bad_values(bus) == 1
    issue_and_hop_one(bus)  # was refused (WRONGTYPE inside the script) for every service
    ledger = bus.ledger()
    assert (ledger.issued, ledger.in_flight) == (1, 1)
    assert ledger.damaged and not ledger.balanced  # what the planted key replaced is lost
    assert bad_values(bus) == 2  # the read, then the replacement


def test_a_ledger_count_that_is_not_an_integer_is_skipped_and_restarts_at_the_next_count(
    bus: StreamBus,
) -> None:
    bus.issue([{"job": b"0"}])
    bus.redis.hset(bus.keys.ledger, mapping={"issued": "lots", "junk": "\xff"})
    ledger = bus.ledger()
    assert (
        ledger.issued == 0 and ledger.damaged and not ledger.balanced
    )  # the count is lost: reported, not hidden
    assert bad_values(bus) == 2
    issue_and_hop_one(bus)
    assert int(bus.redis.hget(bus.keys.ledger, "issued")) == 1
    assert bad_values(bus) == 3
    bus.redis.hdel(bus.keys.ledger, "junk")
    # Every count reads as an integer again, but one was lost: the ledger stays damaged.
    assert bus.ledger().damaged and not bus.ledger().balanced


def test_a_stray_field_in_the_ledger_is_skipped_without_damaging_it(bus: StreamBus) -> None:
    issue_and_hop_one(bus)
    bus.redis.hset(bus.keys.ledger, "junk", "x")
    ledger = bus.ledger()
    assert ledger.balanced and not ledger.damaged and bad_values(bus) == 1


def test_a_hop_that_meets_planted_counts_moves_its_entry_exactly_once(bus: StreamBus) -> None:
    """The script's stream writes come before its counts, and Redis does not roll a script back:
    a count that failed would leave the entry moved but uncounted, and the caller retrying."""
    gate = bus.keys.scored  # the gatekeeper's stage
    bus.redis.xadd(gate.stream, {"g": b"1"})
    [(entry_id, _)] = bus.read(gate, count=1, block_ms=None)
    bus.redis.hset(bus.keys.ledger, "filtered", "x")
    bus.redis.hset(bus.keys.counters, Counter.GATEKEEPER_KEPT, "9" * 30)  # an integer past 64 bits
    assert bus.hop(gate, entry_id, outcome="filtered", counter=Counter.GATEKEEPER_KEPT)
    assert (
        bus.redis.xlen(gate.stream) == 0
        and bus.redis.xpending(gate.stream, gate.group)["pending"] == 0
    )
    assert bus.ledger().filtered == 1 and bus.ledger().damaged
    assert (
        bus.counters()[Counter.GATEKEEPER_KEPT] == 1
    )  # a counter is a statistic: restarted, no mark
    assert bad_values(bus) == 2


def test_a_count_that_would_overflow_is_restarted(bus: StreamBus) -> None:
    bus.redis.hset(bus.keys.ledger, "issued", str(2**63 - 1))
    assert bus.issue([{"job": b"1"}]) == 1
    assert bus.ledger().issued == 1 and bad_values(bus) == 1


def test_a_damaged_evaluation_count_cannot_stall_admission(bus: StreamBus) -> None:
    """Admission control waits while training jobs are in flight: an evaluation count lost to a
    planted value must not make it see training work that is not there (or less than none)."""
    issue_and_hop_one(bus)
    bus.issue([{"job": b"e"}], evaluation=True)
    bus.redis.hset(bus.keys.ledger, mapping={"eval_issued": "x", "evaluated": 3})
    assert bus.ledger().train_in_flight == 2  # at most what the streams hold (not 2 + 3)
    bus.redis.hset(bus.keys.ledger, mapping={"eval_issued": 1, "evaluated": "x", "eval_dead": -5})
    assert bus.ledger().train_in_flight == 0


def test_a_downstream_stream_of_the_wrong_type_is_replaced_and_the_entry_arrives(
    bus: StreamBus,
) -> None:
    """The hop acknowledges upstream before it appends downstream: a downstream key that refused
    the append would lose the entry. It is replaced, and its readers get their group back."""
    bus.redis.set(bus.keys.rollouts.stream, "garbage")
    issue_and_hop_one(bus)
    assert bad_values(bus) == 1
    assert (
        bus.read(bus.keys.rollouts, count=10, block_ms=None) == []
    )  # the group went with the key: recreated
    [(_, fields)] = bus.read(bus.keys.rollouts, count=10, block_ms=None)
    assert fields == {b"x": b"1"}
    assert bus.ledger().balanced
