"""Values in Redis that the services did not write: each malformed heartbeat or weight
announcement is skipped and counted (`bad_redis_values`), never fatal to its reader; the
dead-letter stream stays bounded however much poison arrives; the weight-sync store listens on
the configured host only."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from contracts.bus import StreamBus, connect
from contracts.bus import transport as bus_transport
from contracts.keys import Counter, Keys
from contracts.runtime import StopFlag
from contracts.signing import sign
from rollout.weight_receiver import WeightReceiver
from tests.contracts.test_weight_sync import publisher as weight_publisher
from tests.helpers import WEIGHTS_KEY, wait_for


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("hostile"), consumer="c")
    b.ensure_groups()
    return b


GARBAGE_HEARTBEATS = [
    b"not json",
    b"[1, 2]",
    b'"a string"',
    b'{"role": "rollout"}',
    b'{"id": 7, "at": 1}',
    b'{"id": "r9", "at": "yesterday"}',
    b'{"id": "r9", "at": 1, "policy_version": "new"}',
    b'{"id": "r9", "at": 1, "policy_version": 1e999}',
]


def test_malformed_heartbeats_are_skipped_and_counted(bus: StreamBus) -> None:
    good = {"id": "r0", "role": "rollout", "at": time.time(), "policy_version": 4}
    bus.redis.set(bus.keys.heartbeat("rollout", "r0"), json.dumps(good))
    for i, raw in enumerate(GARBAGE_HEARTBEATS):
        bus.redis.set(bus.keys.heartbeat("rollout", f"bad{i}"), raw)
    live = bus.live_instances("rollout")
    assert [i["id"] for i in live] == ["r0"] and live[0]["policy_version"] == 4
    assert bus.counters()[Counter.BAD_REDIS_VALUES] == len(GARBAGE_HEARTBEATS)
    publisher = weight_publisher(bus, timeout_s=5.0)
    assert publisher.replica_versions() == {"r0": 4}  # the learner's weight sync reads the same
    assert bus.counters()[Counter.BAD_REDIS_VALUES] == len(
        GARBAGE_HEARTBEATS
    )  # each counted once, not per read
    bus.redis.set(bus.keys.heartbeat("rollout", "bad0"), b"other garbage")  # a new value is news
    bus.live_instances("rollout")
    assert bus.counters()[Counter.BAD_REDIS_VALUES] == len(GARBAGE_HEARTBEATS) + 1


class Engine:
    receives_on_host = True

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def update_weights(self, weights: object) -> None:
        self.weights = {n: t.clone() for n, t in weights}  # type: ignore[attr-defined]

    def load_weights_from_dir(self, path: str) -> None:
        pass


def test_a_malformed_announcement_is_skipped_and_the_next_one_lands(
    bus: StreamBus, tmp_path: Path
) -> None:
    stop = StopFlag()
    engine = Engine()
    sub = WeightReceiver(
        bus,
        engine,
        "r0",
        checkpoint_dir=str(tmp_path),
        base_model_path="base",
        lost_contact_s=1e9,
        max_staleness=1,
        stop=stop,
        key=WEIGHTS_KEY,
        expected={"w": (3,)},
    )
    sub.start()
    try:
        bus.redis.set(
            bus.keys.heartbeat("rollout", "r0"),
            json.dumps({"id": "r0", "at": time.time(), "policy_version": 0}),
        )
        for raw in [
            b"{",
            b"[]",
            json.dumps({"replicas": "r0"}).encode(),
            json.dumps({"replicas": ["r0"], "backend": "x", "store_host": 1}).encode(),
            NESTED,
        ]:
            # Signed, as if the learner had written them: the parsing is what is tested here.
            bus.redis.xadd(bus.keys.weights, {"ann": raw, "sig": sign(WEIGHTS_KEY, raw)})
        bus.redis.xadd(bus.keys.weights, {"other": b"field"})
        named = [("w", torch.ones(3))]
        publisher = weight_publisher(bus)
        publisher.stage(1, iter(named), named)
        assert publisher.publish()
        wait_for("version 1 applied", lambda: sub.between_steps() == 1, timeout_s=30, every_s=0.01)
        assert sub.policy_version == 1 and torch.equal(engine.weights["w"], torch.ones(3))
        assert bus.counters()[Counter.BAD_REDIS_VALUES] == 6
    finally:
        stop.event.set()


def test_the_dead_letter_stream_is_bounded(bus: StreamBus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bus_transport, "DEAD_LETTER_MAXLEN", 200)
    stage = bus.keys.rollouts
    for i in range(1000):
        bus.redis.xadd(stage.stream, {"poison": str(i).encode()})
    for entry_id, fields in bus.read(stage, count=1000, block_ms=None):
        bus.dead_letter(stage, entry_id, fields, "garbage")
    assert bus.redis.xlen(bus.keys.dead) < 400  # trimmed approximately (whole radix-tree nodes)
    assert bus.counters()[Counter.POISON_MESSAGES] == 1000  # every one still counted


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc/net/tcp and tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                out.add(address)
    return out


def test_the_weight_sync_store_listens_on_the_configured_host_only(bus: StreamBus) -> None:
    publisher = weight_publisher(bus, timeout_s=5.0)
    assert listening_addresses(publisher.port) == {
        socket.inet_aton("127.0.0.1")[::-1].hex().upper()
    }


def test_long_work_keeps_its_claim_and_only_a_dead_workers_entry_is_reclaimed(
    bus: StreamBus,
) -> None:
    stage = bus.keys.prompts
    bus.redis.xadd(stage.stream, {"job": b"1"})
    worker, other = bus.as_consumer("worker"), bus.as_consumer("other")
    [(entry_id, _)] = worker.read(stage, count=1, block_ms=None)
    with worker.claims_kept(stage, [entry_id], every_s=0.1):
        time.sleep(1.0)  # the work takes over three claim timeouts
        assert other.reclaim(stage, min_idle_s=0.3, max_deliveries=5) == []
    time.sleep(0.5)  # the worker died without finishing: nobody renews any more
    taken = other.reclaim(stage, min_idle_s=0.3, max_deliveries=5)
    assert [e for e, _ in taken] == [entry_id]
    assert (
        worker.renew_claims(stage, [entry_id]) == 0
    )  # taken over: the old worker does not steal it back
    pending = bus.redis.xpending_range(stage.stream, stage.group, min="-", max="+", count=10)
    assert [p["consumer"] for p in pending] == [b"other"] and pending[0]["times_delivered"] == 2


NESTED = b"[" * 2000 + b"]" * 2000  # 4 KB; json.loads raised RecursionError, which no reader caught


def test_json_nested_2000_deep_is_skipped_by_every_bus_reader(bus: StreamBus) -> None:
    """One SET or XADD of nested brackets crashed the learner (heartbeats, evaluation history),
    the API and the replicas; each reader now skips it, and a heartbeat is counted as well."""
    good = {"id": "r0", "role": "rollout", "at": time.time(), "policy_version": 4}
    bus.redis.set(bus.keys.heartbeat("rollout", "r0"), json.dumps(good))
    bus.redis.set(bus.keys.heartbeat("rollout", "deep"), NESTED)
    assert [i["id"] for i in bus.live_instances("rollout")] == ["r0"]
    assert bus.counters()[Counter.BAD_REDIS_VALUES] == 1
    bus.redis.hset(bus.keys.run_info, "eval_history", NESTED)
    assert bus.eval_history() == []
    bus.append_metrics({"step": 1, "loss": 0.5})
    bus.redis.xadd(bus.keys.metrics, {"m": NESTED})
    assert [m["step"] for m in bus.recent_metrics()] == [1]
    bus.write_final_stats("rollout", "r0", {"groups": 3})
    bus.redis.hset(bus.keys.final_stats("rollout", "deep"), "groups", NESTED)
    assert bus.final_stats("rollout") == {"r0": {"groups": 3}}
