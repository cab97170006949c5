"""A rollout replica stops responding in the middle of a weight sync (SIGSTOP while the learner
is broadcasting): the broadcast times out after `learner.collective_timeout_s`, the learner
drops the replica and trains on with the others, and when the replica wakes up it first loads
the newest committed checkpoint (it is too far behind to be useful) and then takes the learner's
catch-up sync. The learner never blocks longer than its timeout, and no version goes backwards."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from services.run.redis_server import RedisServer
from tests.helpers import counter, finish, learner_step, start_run, versions_by_pid, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]

TIMEOUT_S = 10


def test_replica_hung_mid_sync_is_dropped_and_catches_up_from_the_checkpoint_store(
    tmp_path: Path,
) -> None:
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        proc = start_run(
            tmp_path,
            server.url,
            "learner.total_steps=40",
            "checkpoint.every_steps=4",
            f"learner.collective_timeout_s={TIMEOUT_S}",
        )
        wait_for(
            "step 5 and two replicas", lambda: learner_step(r) >= 5 and len(versions_by_pid(r)) == 2
        )
        hung = min(versions_by_pid(r))
        # Catch the learner in a sync: it announces the state, then gathers and broadcasts.
        wait_for(
            "a weight sync",
            lambda: r.hget("dapo:learner:state", "state") == b"broadcasting",
            every_s=0.002,
        )
        os.kill(hung, signal.SIGSTOP)
        stopped_at, step_at_stop = time.monotonic(), learner_step(r)
        try:
            # The learner must get past the hung broadcast (bounded by its timeout) and train on.
            wait_for(
                "three more steps without the hung replica",
                lambda: learner_step(r) >= step_at_stop + 3,
                timeout_s=TIMEOUT_S * 2 + 60,
            )
            trained_on_s = time.monotonic() - stopped_at
            # ...for long enough that a newer checkpoint exists than what the replica holds.
            wait_for(
                "a newer checkpoint", lambda: learner_step(r) >= step_at_stop + 9, timeout_s=120
            )
        finally:
            os.kill(hung, signal.SIGCONT)
        woke_at = time.monotonic()
        wait_for(
            "a load from the checkpoint store",
            lambda: counter(r, "replica_store_catch_ups") >= 1,
            timeout_s=60,
        )
        from_store_s, from_store = time.monotonic() - woke_at, versions_by_pid(r).get(hung, -1)
        wait_for(
            "the learner's catch-up sync",
            lambda: versions_by_pid(r).get(hung, -1) > from_store,
            timeout_s=60,
        )
        synced_s = time.monotonic() - woke_at
        summary = finish(proc, tmp_path)
    print(
        f"hung replica: the learner trained 3 more steps {trained_on_s:.1f}s after SIGSTOP "
        f"(broadcast timeout {TIMEOUT_S}s); after SIGCONT the replica loaded version {from_store} "
        f"from the checkpoint store in {from_store_s:.1f}s and took the learner's sync "
        f"{synced_s:.1f}s after waking"
    )
    counters = summary["counters"]
    assert (
        counters.get("weight_sync_failures", 0) + counters.get("weight_sync_dropped_replicas", 0)
        >= 1
    )
    assert trained_on_s < TIMEOUT_S * 2 + 45  # bounded by the timeouts, never forever
    assert summary["steps"] == 40 and summary["restarts"] == {}
    assert summary["ledger"]["balanced"] and summary["ledger"]["in_flight"] == 0
    assert counters.get("replica_version_regressions", 0) == 0
    assert (
        counters.get("replica_refused_checkpoints", 0) == 0
    )  # the learner's own checkpoints verify
    assert set(summary["replica_final_versions"].values()) == {summary["policy_version"]}
