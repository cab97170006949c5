"""Redis at maxmemory: writers pause (loudly) instead of failing or dropping; the ledger stays
readable; an evicting policy is refused at start."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from contracts.bus import (
    OOM_PAUSE_COUNTER,
    StreamBus,
    check_memory_policy,
    connect,
    is_oom,
    memory_report,
)
from contracts.keys import Keys
from contracts.runtime import Heartbeat


@pytest.fixture()
def full_redis(redis_url: str) -> Iterator[redis.Redis]:
    """The test's Redis with maxmemory set below what it already uses; restored afterwards."""
    admin = redis.Redis.from_url(redis_url)
    admin.set("ballast", b"x" * 200_000)
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) // 2)
    yield admin
    admin.config_set("maxmemory", 0)
    admin.config_set("maxmemory-policy", "noeviction")


def test_a_write_refused_at_maxmemory_waits_and_then_lands(
    redis_url: str, full_redis: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys("t")
    bus = StreamBus(connect(redis_url, counters_key=keys.counters), keys, "c")
    done: dict[str, object] = {}

    def issue() -> None:
        done["count"] = bus.issue([{"x": b"1"}, {"x": b"2"}])

    writer = threading.Thread(target=issue)
    with caplog.at_level("ERROR"):
        writer.start()
        time.sleep(1.5)
        assert writer.is_alive(), "the refused write should be waiting, not failing"
        assert memory_report(full_redis)["at_maxmemory"]
        assert bus.ledger().issued == 0  # readable while full, and nothing half-written
    assert any(
        "maxmemory" in r.getMessage() and "nothing has been dropped" in r.getMessage()
        for r in caplog.records
    )
    full_redis.config_set("maxmemory", 0)
    writer.join(timeout=10)
    assert done["count"] == 2
    ledger = bus.ledger()
    assert ledger.issued == 2 and ledger.in_flight == 2 and ledger.balanced
    assert int(full_redis.hget(keys.counters, OOM_PAUSE_COUNTER) or 0) == 1


def test_a_paused_write_gives_up_when_the_process_is_stopping(
    redis_url: str, full_redis: redis.Redis
) -> None:
    stop = threading.Event()
    client = connect(redis_url, stop=stop)
    threading.Timer(0.5, stop.set).start()
    start = time.monotonic()
    with pytest.raises(redis.OutOfMemoryError):
        client.set("k", "v")
    assert time.monotonic() - start < 5


def test_the_api_client_fails_fast_instead(redis_url: str, full_redis: redis.Redis) -> None:
    with pytest.raises(redis.OutOfMemoryError):
        connect(redis_url, pause_when_full=False).set("k", "v")


def test_an_evicting_policy_is_refused(redis_url: str, full_redis: redis.Redis) -> None:
    check_memory_policy(full_redis)  # noeviction: fine
    full_redis.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(RuntimeError, match=r"allkeys-lru.*noeviction"):
        check_memory_policy(full_redis)


def test_a_heartbeat_at_maxmemory_keeps_the_instance_visible(
    redis_url: str, full_redis: redis.Redis
) -> None:
    keys = Keys("t")
    full_redis.config_set("maxmemory", 0)
    hb = Heartbeat(
        StreamBus(connect(redis_url), keys, "t"),
        "rollout",
        "r-1",
        ttl_s=4,
        status=lambda: {"policy_version": 7},
    )
    hb.beat()
    full_redis.config_set("maxmemory", int(full_redis.info("memory")["used_memory"]) // 2)
    time.sleep(2.5)  # well inside the TTL, even on a loaded machine
    hb.beat()  # SET refused: the TTL is refreshed instead, and it neither raises nor waits
    time.sleep(2.5)  # past the first beat's TTL, well inside the refreshed one
    [info] = StreamBus(full_redis, keys, "t").live_instances("rollout")
    assert info["policy_version"] == 7


def test_redis_62_reports_oom_inside_a_script_as_a_plain_error() -> None:
    assert is_oom(
        redis.ResponseError(
            "Error running script (call to f_x): @user_script:8: -OOM command not allowed when "
            "used memory > 'maxmemory'."
        )
    )
    assert is_oom(redis.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."))
    assert not is_oom(
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    )
