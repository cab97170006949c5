"""Faults during a real run (real processes, a real Redis): workers killed with SIGKILL, and
poison messages in every stream. Each scenario ends with the run finished and the ledger
balanced; the recovery time is printed."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from contracts.bus import StreamBus, connect
from contracts.keys import Keys
from contracts.schemas import RolloutGroup, encode_group, sign_job
from services.api.status import run_status
from services.run.redis_server import RedisServer
from tests.contracts.test_schemas import make_group
from tests.helpers import (
    WEIGHTS_KEY,
    finish,
    judged,
    learner_step,
    pid_of,
    start_run,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def test_kill_rollout_reward_and_gatekeeper_mid_run(tmp_path: Path) -> None:
    """A claim timeout far longer than the run: each killed stage's entries are taken over
    because its heartbeat is gone, or not at all, and the run must end with nothing in flight
    (the end-of-run drain once timed out on a dead replica's jobs)."""
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        proc = start_run(tmp_path, server.url, "learner.total_steps=30", "queue.claim_idle_s=3600")
        recovery = {}
        for role in ("rollout", "reward", "gatekeeper"):
            wait_for("progress", lambda: learner_step(r) >= 4 + 6 * len(recovery))
            at = learner_step(r)
            os.kill(pid_of(r, role), signal.SIGKILL)
            start = time.monotonic()
            wait_for(f"training after killing the {role}", lambda at=at: learner_step(r) >= at + 2)
            recovery[role] = round(time.monotonic() - start, 1)
        summary = finish(proc, tmp_path)
    print(
        f"seconds from SIGKILL to two more training steps: {recovery}; run "
        f"{summary['wall_seconds']}s"
    )
    assert summary["steps"] == 30
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0
    assert summary["counters"].get("trained_twice", 0) == 0
    restarted = summary["restarts"]
    assert restarted.get("reward-0") == 1 and restarted.get("gatekeeper") == 1
    assert sum(v for k, v in restarted.items() if k.startswith("rollout")) == 1


def signed(group: RolloutGroup) -> RolloutGroup:
    """The group of a job the run's learner signed (its key is the tests' own)."""
    return group.model_copy(update={"job": sign_job(group.job, WEIGHTS_KEY)})


def test_poison_messages_are_dead_lettered_and_the_run_goes_on(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        bus = StreamBus(connect(server.url), Keys("dapo"), "injector")
        proc = start_run(tmp_path, server.url, "learner.total_steps=15")
        wait_for("step 3", lambda: learner_step(r) >= 3)
        keys = bus.keys
        # 1. Undecodable bytes with no group id: poison, not a ledger entry.
        r.xadd(keys.prompts.stream, {"junk": b"\xff\x00\xfe"})
        # 2. A group from a producer speaking another schema version (counted as issued by it):
        # its job is the run's learner's, signed, so it dies as one of the run's.
        wrong = encode_group(signed(make_group()))
        wrong.update(v=b"99", group_id=b"poison-version")
        # 3. A scored group of a signed job that lost a response on the way.
        short = encode_group(judged(signed(make_group())))
        meta = json.loads(short["meta"])
        meta["responses"].pop()
        short.update(meta=json.dumps(meta).encode(), group_id=b"poison-short")
        for stream, fields in ((keys.rollouts.stream, wrong), (keys.scored.stream, short)):
            with r.pipeline(transaction=True) as pipe:
                pipe.xadd(stream, fields)
                pipe.hincrby(keys.ledger, "issued", 1)
                pipe.execute()
        wait_for("3 dead letters", lambda: r.xlen(keys.dead) == 3, 60)
        status = run_status(bus, heartbeat_ttl_s=30)
        assert status["dead_letters"] == 3 and status["counters"]["poison_messages"] == 1
        reasons = sorted(f[b"reason"].decode() for _, f in r.xrange(keys.dead))
        summary = finish(proc, tmp_path)
    assert any("schema version b'99'" in x for x in reasons), reasons
    assert any("belong to no response" in x for x in reasons), reasons
    assert any("schema version None" in x or "missing field" in x for x in reasons), reasons
    ledger = summary["ledger"]
    assert summary["steps"] == 15
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["dead"] == 2
