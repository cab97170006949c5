"""Weight sync in one process against a real Redis: bucket planning, staging as the gathered
parameters stream in and `staged()` giving them back, the two-phase join (a silent replica is
set aside and the group re-formed without it), a reused group, the fallback after a failed
broadcast, and the catch-up from the checkpoint store."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contracts.bus import StreamBus, connect
from contracts.checkpoint_store import file_digest, write_manifest
from contracts.config import ConfigError
from contracts.keys import Counter, Keys
from contracts.runtime import StopFlag, free_port
from contracts.signing import WeightKey, sign, signature_holds
from contracts.weight_sync import (
    PORT_ENV,
    Announcement,
    WeightStream,
    plan_buckets,
    weights_port,
)
from learner.weight_publisher import WeightPublisher
from rollout.weight_receiver import WeightReceiver
from tests.helpers import WEIGHTS_KEY, wait_for


def params() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(300, 300, generator=gen)),  # 0.34 MiB
        ("b", torch.randn(300, 300, generator=gen)),
        ("c", torch.randn(10, generator=gen).to(torch.bfloat16)),
        ("d", torch.randn(700, 700, generator=gen)),  # 1.9 MiB: over the limit, alone
        ("e", torch.randn(5, generator=gen)),
    ]


class FakeEngine:
    def __init__(self, fail: bool = False, on_host: bool = False) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.loaded: list[str] = []
        self.fail = fail
        self.receives_on_host = on_host
        self.owner: set[str] = set()  # the threads that touched the engine

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.owner.add(threading.current_thread().name)
        for name, tensor in weights:
            if self.fail:
                raise RuntimeError("died mid-broadcast")
            self.weights[name] = tensor.clone()

    def load_weights_from_dir(self, path: str) -> None:
        self.loaded.append(path)


STOPS: list[StopFlag] = []


@pytest.fixture()
def bus(redis_url: str) -> Iterator[StreamBus]:
    yield StreamBus(connect(redis_url), Keys(f"t{len(STOPS)}-{time.monotonic_ns()}"), consumer="c1")
    stop_replicas()


def stop_replicas() -> None:
    """A subscriber's watcher thread outlives its test unless stopped, and would answer the next
    test's announcements for the same replica id."""
    for stop in STOPS:
        stop.event.set()
    STOPS.clear()


def beat(bus: StreamBus, rid: str, version: int = 0) -> None:
    info = {"id": rid, "role": "rollout", "at": time.time(), "policy_version": version}
    bus.redis.set(bus.keys.heartbeat("rollout", rid), json.dumps(info), ex=60)


def publisher(bus: StreamBus, **options: Any) -> WeightPublisher:
    """The learner's publisher on loopback over gloo, as these tests use it; `options` override."""
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "backend": "gloo",
        "timeout_s": 10.0,
        "bucket_mb": 1,
        "key": WEIGHTS_KEY,
    }
    return WeightPublisher(run_state=bus, telemetry=bus, **(settings | options))


def subscriber(
    bus: StreamBus,
    engine: FakeEngine,
    tmp_path: Path,
    rid: str = "r0",
    expected: dict[str, tuple[int, ...]] | None = None,
) -> WeightReceiver:
    stop = StopFlag()
    STOPS.append(stop)
    return WeightReceiver(
        bus,
        engine,
        rid,
        checkpoint_dir=str(tmp_path / "ckpt"),
        base_model_path="base",
        lost_contact_s=0.0,
        max_staleness=1,
        stop=stop,
        key=WEIGHTS_KEY,
        expected=expected or {name: tuple(t.shape) for name, t in params()},
    )


def started_subscriber(
    bus: StreamBus,
    engine: FakeEngine,
    tmp_path: Path,
    expected: dict[str, tuple[int, ...]] | None = None,
) -> WeightReceiver:
    """Replica r0, started and heartbeating, with no store catch-up (broadcasts only)."""
    sub = subscriber(bus, engine, tmp_path, expected=expected)
    sub.lost_contact_s = 1e9
    sub.start()
    beat(bus, "r0")
    return sub


def sent_to_a_replica(
    bus: StreamBus, tmp_path: Path, named: list[tuple[str, torch.Tensor]]
) -> WeightPublisher:
    """A publisher that staged `named` as version 1 and published it to replica r0 (which
    receives in the background and expects exactly `named`), once r0 holds it."""
    pub = publisher(bus)
    engine = FakeEngine(on_host=True)
    sub = started_subscriber(bus, engine, tmp_path, expected={n: tuple(t.shape) for n, t in named})
    pub.stage(1, iter(named), named)
    assert pub.publish()
    wait_for("the version staged", sub.announced.is_set, timeout_s=30, every_s=0.01)
    return pub


def test_plan_buckets_splits_by_dtype_and_size() -> None:
    buckets = plan_buckets(params(), bucket_mb=1)
    assert [[p.name for p in b] for b in buckets] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert buckets[1][0].dtype == "bfloat16" and buckets[2][0].shape == (700, 700)


def test_announcement_and_stream_round_trip_json() -> None:
    ann = Announcement(1, 2, ("r0", "r1"), "h", 5, "gloo", 3.0, plan_buckets(params(), 1))
    assert Announcement.from_json(json.loads(json.dumps(ann.to_json()))) == ann
    assert ann.rank_of("r1") == 2
    stream = WeightStream(ann, 2).on("cpu")
    assert WeightStream.from_json(json.loads(json.dumps(stream.to_json()))) == stream


def test_stage_consumes_lazily_and_staged_round_trips(bus: StreamBus) -> None:
    named = params()
    pub = publisher(bus)
    seen: list[str] = []

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in reversed(named):  # any order works; layout order holds the least
            seen.append(name)
            yield name, t

    assert pub.policy_version == -1 and list(pub.staged()) == []
    pub.stage(3, gathered(), named)
    assert pub.policy_version == 3 and len(seen) == len(named)
    back = dict(pub.staged())
    assert list(back) == [n for n, _ in named]
    for name, t in named:
        assert torch.equal(back[name], t)
    with pytest.raises(ValueError, match="lack"):
        pub.stage(4, iter(named[:2]), named)
    assert pub.policy_version == -1  # a failed stage leaves nothing half-staged


def test_a_publication_records_the_bytes_of_every_published_tensor(
    bus: StreamBus, tmp_path: Path
) -> None:
    """`weight_sync/*` (issue 39): with no replica registered a publication moves nothing; with
    one it moves one copy of every staged tensor, each in its own dtype (fp32 and bf16 here);
    catching a replica up later leaves the step's record alone."""
    named = params()
    idle = publisher(bus)
    idle.stage(1, iter(named), named)
    assert idle.publish()
    assert idle.last_publication.metrics() | {"weight_sync/seconds": 0.0} == {
        "weight_sync/seconds": 0.0,
        "weight_sync/bytes": 0.0,
        "weight_sync/replicas": 0.0,
        "weight_sync/failed": 0.0,
    }
    pub = sent_to_a_replica(bus, tmp_path, named)
    sent = pub.last_publication
    assert sent.nbytes == sum(t.nbytes for _, t in named) == 2_680_040
    assert sent.replicas == 1 and not sent.failed and sent.seconds > 0
    beat(bus, "r0", version=0)  # r0's heartbeat still shows version 0: it looks behind
    pub.join_timeout_s = 1.0
    pub.catch_up(retry_after_s=0.0)
    assert pub.last_publication is sent


@pytest.mark.parametrize("on_host", [False, True], ids=["engine-receives", "background-receive"])
def test_join_sets_aside_silent_replica_then_reuses_group(
    bus: StreamBus, tmp_path: Path, on_host: bool
) -> None:
    named = params()
    pub = publisher(bus)
    pub.join_timeout_s = 1.0
    engine = FakeEngine(on_host=on_host)
    sub = started_subscriber(bus, engine, tmp_path)
    beat(bus, "silent")  # heartbeat alive, loop stuck: never joins
    done = threading.Event()

    def replica() -> None:
        sub.wait_for(2)
        done.set()

    thread = threading.Thread(target=replica, name="replica", daemon=True)
    thread.start()
    pub.stage(1, iter(named), named)
    assert pub.publish()
    assert pub.replicas == ("r0",) and "silent" in pub.quarantined
    assert bus.counters().get(Counter.WEIGHT_SYNC_DROPPED_REPLICAS) == 1
    epoch = pub.membership_epoch
    pub.stage(2, iter([(n, t + 1) for n, t in named]), named)
    assert pub.publish()  # the same replicas: no new join, the group is reused
    assert pub.membership_epoch == epoch
    assert done.wait(30) and sub.policy_version == 2
    for name, t in named:
        assert torch.equal(engine.weights[name], t + 1)
    assert engine.owner == {"replica"}  # only the thread that owns the engine touches it


def test_background_receive_does_not_wait_for_the_engine(bus: StreamBus, tmp_path: Path) -> None:
    """An engine that takes host tensors: the watcher thread joins and receives while the owner is
    busy (it never calls in during the publish); the engine changes only at the owner's next
    `between_steps`, and a newer broadcast staged before that replaces the older one."""
    named = params()
    pub = publisher(bus)
    engine = FakeEngine(on_host=True)
    sub = started_subscriber(bus, engine, tmp_path)
    for version in (1, 2):
        pub.stage(version, iter([(n, t + version) for n, t in named]), named)
        assert pub.publish()  # returns although the owner thread never looked
        wait_for(
            "the version staged", sub.announced.is_set, timeout_s=30, every_s=0.01
        )  # raised once staged
        sub.announced.clear()
    assert engine.weights == {} and sub.policy_version == 0
    sub.announced.set()  # as the watcher left it
    assert sub.between_steps() == 2
    for name, t in named:
        assert torch.equal(engine.weights[name], t + 2)
    assert sub.between_steps() == 2 and len(engine.owner) == 1  # nothing new: nothing applied


def test_a_failed_background_receive_leaves_the_engine_untouched(
    bus: StreamBus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    named = params()
    pub = publisher(bus)
    pub.timeout_s = 2.0
    engine = FakeEngine(on_host=True)
    sub = started_subscriber(bus, engine, tmp_path)
    real_iter = WeightStream.__iter__

    def dies_after_one_bucket(self: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(real_iter(self)):
            if i == 2:
                raise RuntimeError("the connection dropped")
            yield item

    monkeypatch.setattr(WeightStream, "__iter__", dies_after_one_bucket)
    pub.stage(1, iter(named), named)
    assert not pub.publish()
    # a failed broadcast reports what it cost and that no replica took the version
    failed = pub.last_publication
    assert failed.failed and failed.nbytes == 0 and failed.replicas == 0 and failed.seconds > 0
    sub.between_steps()
    assert engine.weights == {} and engine.loaded == [] and sub.policy_version == 0
    monkeypatch.setattr(WeightStream, "__iter__", real_iter)
    assert pub.publish()  # a fresh group; this one lands
    assert not pub.last_publication.failed and pub.last_publication.replicas == 1
    wait_for("the version staged", sub.announced.is_set, timeout_s=30, every_s=0.01)
    assert sub.between_steps() == 1


def test_failed_receive_falls_back_to_published_weights(bus: StreamBus, tmp_path: Path) -> None:
    named = params()
    pub = publisher(bus)
    pub.timeout_s = 2.0
    engine = FakeEngine(fail=True)
    sub = started_subscriber(bus, engine, tmp_path)
    thread = threading.Thread(target=lambda: sub.poll(block_ms=5000), daemon=True)
    thread.start()
    pub.stage(1, iter(named), named)
    assert not pub.publish()
    thread.join(30)
    assert engine.loaded == ["base"] and sub.policy_version == 0  # no checkpoint: the base model
    assert bus.counters().get(Counter.WEIGHT_SYNC_FAILURES) == 1


def test_catch_up_from_store_after_losing_contact(bus: StreamBus, tmp_path: Path) -> None:
    engine = FakeEngine()
    sub = subscriber(bus, engine, tmp_path)
    step = tmp_path / "ckpt" / "step_7"
    (step / "hf").mkdir(parents=True)
    (step / "trainer.json").write_text(json.dumps({"policy_version": 5}))
    write_manifest(
        step, 7, {"trainer.json": file_digest(step / "trainer.json")}
    )  # replicas load only what verifies
    (step / "COMMITTED").touch()
    bus.set_policy_version(1)
    assert not sub.catch_up()  # within max_staleness: wait for the learner
    bus.set_policy_version(6)
    assert sub.catch_up()
    assert engine.loaded == [str(step / "hf")] and sub.policy_version == 5
    assert bus.counters().get(Counter.REPLICA_STORE_CATCH_UPS) == 1
    assert not sub.catch_up()  # just loaded: in contact again


def test_buckets_can_be_planned_in_the_serving_dtype() -> None:
    """fp32 master weights are staged and sent in the replicas' dtype (half the bytes in bf16)."""
    layout = [("a", torch.zeros(4, 4)), ("b", torch.zeros(8))]
    [bucket] = plan_buckets(layout, bucket_mb=1, dtype="bfloat16")
    assert [p.dtype for p in bucket] == ["bfloat16", "bfloat16"]
    assert [p.dtype for p in plan_buckets(layout, bucket_mb=1)[0]] == ["float32", "float32"]


def test_an_announcement_round_trips_without_json_too() -> None:
    """`to_json` output handed over directly (a spawned receiver's arguments) keeps tuples."""
    ann = Announcement(
        1, 2, ("r0", "r1"), "h", 5, "gloo", 3.0, plan_buckets(params(), 1), publisher="p"
    )
    assert Announcement.from_json(ann.to_json()) == ann


def forged(version: int = 10**9, **changes: object) -> dict:
    """The probe's announcement: replica r0 told to join a rendezvous elsewhere and take 1337s."""
    ann = Announcement(
        version, 1, ("r0",), "10.9.9.9", 29555, "gloo", 30.0, plan_buckets(params(), 1)
    ).to_json()
    return {**ann, **changes}


@pytest.mark.parametrize("on_host", [False, True], ids=["foreground", "background"])
def test_a_forged_announcement_is_refused_and_the_replica_keeps_going(
    bus: StreamBus, tmp_path: Path, on_host: bool
) -> None:
    """Whoever has the Redis password but not the weight-sync key: an unsigned announcement (plus
    a planted "go"), one signed with another key, and signed ones asking for a host other than
    the learner's, another model's shapes, an unknown dtype, or a version past every bound.
    The replica joins none of them, allocates nothing, keeps its weights and version, counts
    each, and then takes the learner's real broadcast."""
    engine = FakeEngine(on_host=on_host)
    sub = subscriber(bus, engine, tmp_path)
    sub.lost_contact_s = 1e9
    sub.expected_host = "127.0.0.1"  # DAPO_WEIGHTS_HOST
    sub.start()
    beat(bus, "r0")
    probe = Announcement.from_json(forged())
    bus.redis.set(bus.keys.weight_decision(probe.group_key), "go")
    assert sub.channel.decision(probe) is None  # a planted go is no decision

    def signed(data: dict, key: WeightKey = WEIGHTS_KEY) -> dict[str, bytes | str]:
        body = json.dumps(data).encode()
        return {"ann": body, "sig": sign(key, body)}

    bad_shape, bad_dtype = forged(), forged()
    bad_shape["buckets"][0][0]["shape"] = (1337, 1337)  # "a" of another model: a larger buffer
    for spec in bad_dtype["buckets"][0]:
        spec["dtype"] = "int64"
    attempts = [
        {"ann": json.dumps(forged()).encode()},  # unsigned
        signed(forged(), key=Ed25519PrivateKey.generate()),  # another learner's key
        signed(forged()),  # signed, but the host is not the learner's
        signed({**bad_shape, "store_host": "127.0.0.1"}),
        signed({**bad_dtype, "store_host": "127.0.0.1"}),
        signed(forged(version=2**40, store_host="127.0.0.1")),
    ]
    started = time.monotonic()
    for fields in attempts:
        bus.redis.xadd(bus.keys.weights, fields)
    wait_for(
        "every forgery counted",
        lambda: (
            sub.between_steps() == 0
            and bus.counters().get(Counter.BAD_REDIS_VALUES, 0) >= len(attempts) + 1
        ),
        timeout_s=20,
        every_s=0.05,
    )
    assert time.monotonic() - started < 10  # no rendezvous was waited for
    assert engine.weights == {} and sub.policy_version == 0
    assert sub.group_key == "" and not bus.redis.keys(f"{bus.keys.ns}:weights:joined:*")
    assert bus.counters()[Counter.BAD_REDIS_VALUES] == len(attempts) + 1
    replica = threading.Thread(target=sub.wait_for, args=(1,), name="replica", daemon=True)
    replica.start()
    named = params()
    pub = publisher(bus)
    pub.stage(1, iter(named), named)
    assert pub.publish()
    replica.join(30)
    assert sub.policy_version == 1 and torch.equal(engine.weights["a"], named[0][1])
    # The learner's own announcement, copied back into the stream later: signed, but a replay.
    [(_, real)] = bus.redis.xrevrange(bus.keys.weights, count=1)
    bus.redis.xadd(bus.keys.weights, real)
    wait_for(
        "the replay refused",
        lambda: (
            sub.between_steps() == 1
            and bus.counters()[Counter.BAD_REDIS_VALUES] == len(attempts) + 2
        ),
        timeout_s=20,
        every_s=0.05,
    )


def test_the_replica_and_the_learner_refuse_to_start_without_the_key() -> None:
    from contracts.config import ConfigError
    from contracts.signing import (
        KEY_ENV,
        PUBLIC_KEY_ENV,
        new_weights_key,
        public_key_text,
        weights_key,
        weights_public_key,
    )

    with pytest.raises(ConfigError, match=f"{KEY_ENV} is not set"):
        weights_key({})
    with pytest.raises(ConfigError, match=f"{PUBLIC_KEY_ENV} is not set"):
        weights_public_key({})
    with pytest.raises(ConfigError, match=r"is not 64 hex characters.*dapo secrets"):
        weights_key({KEY_ENV: "k" * 64})  # an HMAC secret of the old kind
    private, public = new_weights_key()
    assert public_key_text(private) == public
    message = b"announcement"
    assert signature_holds(
        weights_public_key({PUBLIC_KEY_ENV: public}),
        message,
        sign(weights_key({KEY_ENV: private}), message),
    )


def test_a_replica_holds_a_key_that_verifies_and_cannot_sign() -> None:
    """What a compromised replica holds cannot make an announcement another replica takes."""
    from contracts.signing import PUBLIC_KEY_ENV, weights_public_key

    public = weights_public_key({PUBLIC_KEY_ENV: os.environ[PUBLIC_KEY_ENV]})
    with pytest.raises(TypeError, match="only the learner's private key signs"):
        sign(public, b"announcement")
    forged = Ed25519PrivateKey.generate().sign(b"announcement").hex()
    assert not signature_holds(public, b"announcement", forged)
    assert not signature_holds(public, b"announcement", "zz" * 64)  # not even hex
    assert signature_holds(public, b"announcement", sign(WEIGHTS_KEY, b"announcement"))


def test_the_weight_sync_store_listens_on_the_port_a_network_policy_opens(
    bus: StreamBus,
) -> None:
    """Kubernetes fixes DAPO_WEIGHTS_PORT so its NetworkPolicy can open that port alone (beside
    the collectives' range) to the replicas; a value that is no port fails naming the variable."""
    assert weights_port({}) == 0 and weights_port({PORT_ENV: " 29600 "}) == 29600
    for bad in ("http", "-1", "70000"):
        with pytest.raises(ConfigError, match=PORT_ENV):
            weights_port({PORT_ENV: bad})
    port = free_port()
    listening = publisher(bus, port=port, timeout_s=5)  # held: its store closes with it
    assert listening.port == port
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # the store accepts connections there
