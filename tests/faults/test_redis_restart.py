"""Redis restarted mid-run with AOF on: every service reconnects with bounded back-off, nothing
acknowledged is lost, and the run finishes with the ledger balanced."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from contracts.bus.prompt_history import RECORD, PromptStats, decode_record
from services.run.redis_server import RedisServer
from tests.helpers import finish, learner_step, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def prompt_history(r: redis.Redis) -> list[PromptStats]:
    """Every record of the run's prompt history (`contracts.bus.prompt_history`)."""
    raw = r.get("dapo:prompt_history") or b""
    return [decode_record(raw[at : at + RECORD.size]) for at in range(0, len(raw), RECORD.size)]


def test_redis_restart_with_aof_loses_nothing(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    proc = start_run(tmp_path, server.url, "learner.total_steps=25")
    try:
        r = redis.Redis.from_url(server.url)
        wait_for("step 6", lambda: learner_step(r) >= 6)
        before = {k.decode(): int(v) for k, v in r.hgetall("dapo:ledger").items()}
        history_before = prompt_history(r)
        server.stop()  # SIGTERM: Redis fsyncs the AOF and exits
        time.sleep(3)
        server = RedisServer(tmp_path / "redis", port=server.port, appendonly=True).start()
        r = redis.Redis.from_url(server.url)
        after = {k.decode(): int(v) for k, v in r.hgetall("dapo:ledger").items()}
        assert all(after.get(k, 0) >= v for k, v in before.items()), (
            before,
            after,
        )  # nothing acknowledged was lost
        # Nor any prompt's history (what prompt skipping decides from): every record is back,
        # at least as far along as before.
        history_after = prompt_history(r)
        assert len(history_before) > 0 and len(history_after) >= len(history_before)
        assert all(
            after.seen >= prior.seen
            for prior, after in zip(history_before, history_after, strict=False)
        )
        restarted_at = time.monotonic()
        at = learner_step(r)
        wait_for("training after the restart", lambda: learner_step(r) >= at + 2, 180)
        print(
            "seconds from Redis back to two more training steps: "
            f"{time.monotonic() - restarted_at:.1f}"
        )
        summary = finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert summary["steps"] == 25
    assert summary["ledger"]["balanced"] and summary["ledger"]["in_flight"] == 0
    assert summary["counters"].get("trained_twice", 0) == 0
    assert summary["restarts"] == {}  # every service rode out the outage


def test_redis_restart_without_aof_is_detected_and_reported(tmp_path: Path) -> None:
    """With persistence off a restart loses the queues and the ledger: that must be detected,
    reported in /status and the counters, and the run must carry on, not hang or crash."""
    from contracts.bus import StreamBus, connect
    from contracts.keys import Keys
    from services.api.status import run_status

    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    proc = start_run(tmp_path, server.url, "learner.total_steps=20")
    try:
        r = redis.Redis.from_url(server.url)
        wait_for("step 6", lambda: learner_step(r) >= 6)
        server.stop()
        time.sleep(2)
        server = RedisServer(tmp_path / "redis", port=server.port, appendonly=False).start()
        bus = StreamBus(connect(server.url), Keys("dapo"), "test")
        status = wait_for(
            "the loss reported",
            lambda: (s := run_status(bus, heartbeat_ttl_s=30))["redis_data_lost_at"] and s,
            120,
        )
        assert status["counters"]["redis_data_loss"] == 1
        summary = finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert summary["steps"] == 20
    assert summary["counters"]["redis_data_loss"] == 1
    assert summary["ledger"]["balanced"] and summary["ledger"]["in_flight"] == 0
    assert summary["restarts"] == {}  # detected and carried on: no service crashed
