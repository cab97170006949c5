"""A hostile Redis, with real processes: while `dapo run` trains, garbage is written every half
second into every key the services read (heartbeats, the control hash, the learner state, the
policy version, run info, the weights stream, every stage stream, the metrics stream, the
counters, a stray ledger field, final stats), and some keys are replaced by values of the wrong type
(a string where a hash belongs, a hash where a string belongs). The learner is killed once
meanwhile, so that its successor starts from a planted data cursor and policy version. Nothing dies
of it: each malformed value is skipped and counted (or dead-lettered, for stream entries; a wrongly
typed key a service writes is replaced), the run finishes its steps, and the ledger balances.

The one key left alone is the learner lease: a value there that is not our token is, by design,
indistinguishable from another learner holding it (`contracts/lease.py`), and stops
this learner's writes."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import redis

from contracts.keys import Counter, Keys, RunField
from tests.helpers import finish, learner_step, pid_of, pids, process_gone, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]

GARBAGE = [b"", b"\xff\xfe", b"not json", b"[1, 2]", b"{", b'{"id": 7}', b'"x"', b"1e999", b"-1"]


def vandal(r: redis.Redis, keys: Keys, stop: threading.Event) -> None:
    round_ = 0
    while not stop.wait(0.5):
        junk = GARBAGE[round_ % len(GARBAGE)]
        round_ += 1
        pipe = r.pipeline(transaction=False)
        pipe.set(keys.heartbeat("rollout", "evil"), junk, ex=30)
        pipe.set(
            keys.heartbeat("reward", "evil"),
            b'{"id": "r", "at": "noon", "policy_version": "x"}',
            ex=30,
        )
        pipe.hset(
            keys.control,
            mapping={
                "restore": junk or b"?",
                "pause": b'{"kind": "pause", "at": "x"}',
                "junk": b'{"kind": "restore", "step": "abc"}',
            },
        )
        pipe.hset(keys.learner_state, mapping={"at": junk or b"?", "extra": b"\x00"})
        pipe.hset(
            keys.run_info,
            mapping={
                str(RunField.EVAL_HISTORY): junk or b"?",
                str(RunField.DATA_CURSOR): b"x" + junk,
                "junk": junk or b"?",
            },
        )
        pipe.set(keys.policy_version, b"v" + junk)
        pipe.hset(keys.counters, "junk", junk or b"?")
        pipe.hset(keys.ledger, "junk", junk or b"?")  # read by every service's flow control
        pipe.hset(
            keys.final_stats("rollout", "evil"),
            mapping={"policy_version": b'"x"', "idle_fraction": b"[1]"},
        )
        pipe.xadd(keys.weights, {"ann": junk or b"?"})
        pipe.xadd(keys.metrics, {"m": junk or b"?"})
        for stage in keys.stages:
            pipe.xadd(stage.stream, {"garbage": junk or b"?", "meta": b"{"})
        if (
            round_ % 4 == 0
        ):  # keys of the wrong type: the readers skip them, the writers replace them
            for key in (keys.control, keys.learner_state):
                pipe.delete(key)
                pipe.set(key, junk)
            pipe.delete(keys.policy_version)
            pipe.hset(keys.policy_version, "x", junk or b"?")
            pipe.hset(keys.heartbeat("rollout", "typed"), "id", b"x")
            # A counter the gatekeeper's hop script increments: the script restarts it.
            pipe.hset(keys.counters, str(Counter.GATEKEEPER_KEPT), b"x" + junk)
            pipe.expire(keys.heartbeat("rollout", "typed"), 30)
        pipe.execute(raise_on_error=False)  # some writes meet a key of the wrong type: so be it


def step_now(r: redis.Redis) -> int:
    try:
        return learner_step(r)
    except redis.ResponseError:  # the vandal has just made the state hash a string
        return 0


def test_garbage_in_every_key_the_services_read(tmp_path: Path, redis_url: str) -> None:
    steps = 40
    proc = start_run(
        tmp_path, redis_url, f"learner.total_steps={steps}", "checkpoint.every_steps=5"
    )
    r = redis.Redis.from_url(redis_url)
    wait_for("step 3", lambda: step_now(r) >= 3, timeout_s=600)
    stop = threading.Event()
    thread = threading.Thread(target=vandal, args=(r, Keys("dapo"), stop), daemon=True)
    thread.start()
    try:
        wait_for("step 12", lambda: step_now(r) >= 12, timeout_s=600)
        killed = pid_of(r, "learner")
        os.kill(killed, signal.SIGKILL)
        wait_for("the learner gone", lambda: process_gone(killed))
        # What its successor reads first: a data cursor and a policy version that are garbage.
        r.hset(Keys("dapo").run_info, str(RunField.DATA_CURSOR), b"twelve")
        r.set(Keys("dapo").policy_version, b"\xff")
        wait_for("a new learner", lambda: bool(pids(r, "learner") - {killed}), timeout_s=300)
        wait_for("step 30", lambda: step_now(r) >= 30, timeout_s=600)
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
    assert summary["restarts"] == {"learner": 1}  # the kill above, and no crash after it
    assert (
        summary["replica_final_versions"]["evil"] == -1
    )  # a planted final-stats value reads as unknown
    for log in (tmp_path / "run" / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
