"""A hostile Redis, with real processes: while `dapo run` trains, garbage is written every half
second into every key the services read (heartbeats, the control hash, the learner state, the
policy version, run info, the weights stream, every stage stream, the metrics stream, the
counters). Nothing dies of it: each malformed value is skipped and counted (or dead-lettered,
for stream entries), the run finishes its steps, and the ledger balances.

The one key left alone is the learner lease: a value there that is not our token is, by design,
indistinguishable from another learner holding it (`services/contracts/lease.py`), and stops
this learner's writes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from services.contracts.keys import Keys, RunField
from tests.helpers import finish, learner_step, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]

GARBAGE = [b"", b"\xff\xfe", b"not json", b"[1, 2]", b"{", b'{"id": 7}', b'"x"', b"1e999", b"-1"]


def vandal(r: redis.Redis, keys: Keys, stop: threading.Event) -> None:
    round_ = 0
    while not stop.wait(0.5):
        junk = GARBAGE[round_ % len(GARBAGE)]
        round_ += 1
        pipe = r.pipeline(transaction=False)
        pipe.set(keys.heartbeat("rollout", "evil"), junk, ex=30)
        pipe.set(keys.heartbeat("reward", "evil"), b'{"id": "r", "at": "noon", "policy_version": "x"}', ex=30)
        pipe.hset(keys.control, mapping={"restore": junk or b"?", "pause": b'{"kind": "pause", "at": "x"}',
                                         "junk": b'{"kind": "restore", "step": "abc"}'})
        pipe.hset(keys.learner_state, mapping={"at": junk or b"?", "extra": b"\x00"})
        pipe.hset(keys.run_info, mapping={str(RunField.EVAL_HISTORY): junk or b"?", "junk": junk or b"?"})
        pipe.hset(keys.counters, "junk", junk or b"?")
        pipe.xadd(keys.weights, {"ann": junk or b"?"})
        pipe.xadd(keys.metrics, {"m": junk or b"?"})
        for stage in keys.stages:
            pipe.xadd(stage.stream, {"garbage": junk or b"?", "meta": b"{"})
        pipe.execute()


def test_garbage_in_every_key_the_services_read(tmp_path: Path, redis_url: str) -> None:
    steps = 40
    proc = start_run(tmp_path, redis_url, f"learner.total_steps={steps}")
    r = redis.Redis.from_url(redis_url)
    wait_for("step 3", lambda: learner_step(r) >= 3, timeout_s=600)
    stop = threading.Event()
    thread = threading.Thread(target=vandal, args=(r, Keys("dapo"), stop), daemon=True)
    thread.start()
    try:
        wait_for("step 30", lambda: learner_step(r) >= 30, timeout_s=600)
    finally:
        stop.set()
        thread.join()
    summary = finish(proc, tmp_path)
    assert summary["steps"] == steps
    ledger, counters = summary["ledger"], summary["counters"]
    assert ledger["balanced"], ledger
    assert counters.get("trained_twice", 0) == 0
    assert counters["poison_messages"] > 0  # garbage stream entries were dead-lettered, not trained
    assert counters["bad_control_requests"] > 0 and counters["bad_redis_values"] > 0
    for log in (tmp_path / "run" / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
