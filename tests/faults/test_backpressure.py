"""Back-pressure (real processes, a real Redis): a learner 10x slower than rollout keeps the
queues and Redis memory bounded; a rollout fleet 10x slower keeps the learner waiting, not
failing; Redis at maxmemory pauses the services with a clear error and loses nothing.

The figures (peak in-flight jobs against the admission limit, peak Redis memory, idle fractions,
the pause) are printed; run with `-s` to see them."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import redis

from contracts.bus import OOM_PAUSE_COUNTER, StreamBus, connect
from contracts.config import load_config
from contracts.keys import Keys
from learner.feeder import PromptFeeder
from services.api.status import run_status
from services.run.redis_server import RedisServer
from tests.helpers import REPO, finish, learner_step, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]

MIB = 1 << 20


class Sampler(threading.Thread):
    """Samples stream depths, jobs in flight and Redis memory every 0.25 s while a run goes on."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.bus = StreamBus(connect(url, pause_when_full=False), Keys("dapo"), "sampler")
        self.done = threading.Event()
        self.max_in_flight = 0
        self.max_depth: dict[str, int] = {}
        self.peak_used = 0
        self.unbalanced: list[object] = []

    def run(self) -> None:
        while not self.done.wait(0.25):
            try:
                ledger = self.bus.ledger()
                depths = self.bus.depths()
                used = int(self.bus.redis.info("memory")["used_memory"])
            except redis.RedisError:
                continue
            if not ledger.balanced:  # it must balance at every instant, not just at the end
                self.unbalanced.append(ledger)
            self.max_in_flight = max(
                self.max_in_flight, ledger.train_in_flight
            )  # what admission bounds
            for stage, depth in depths.items():
                self.max_depth[stage] = max(self.max_depth.get(stage, 0), depth)
            self.peak_used = max(self.peak_used, used)


def tiny_admission_limit() -> int:
    alg = load_config(REPO / "configs" / "tiny.yaml").algorithm
    return PromptFeeder.admission_limit(alg.max_staleness, alg.train_batch_groups, alg.oversampling)


def test_slow_learner_keeps_queues_and_redis_memory_bounded(tmp_path: Path) -> None:
    limit = tiny_admission_limit()
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        sampler = Sampler(server.url)
        sampler.start()
        # Six slowed steps: the queues fill to the admission limit within the first one, and
        # the replicas then wait for the learner for the rest.
        proc = start_run(
            tmp_path, server.url, "learner.total_steps=6", faults="learner.slowdown=10"
        )
        summary = finish(proc, tmp_path)
        sampler.done.set()
        sampler.join()
        peak = int(redis.Redis.from_url(server.url).info("memory")["used_memory_peak"])
    print(
        f"slow learner: jobs in flight peaked at {sampler.max_in_flight} "
        f"(admission limit {limit}); deepest stages {sampler.max_depth}; "
        f"Redis used_memory peak {peak / MIB:.2f} MiB (sampled {sampler.peak_used / MIB:.2f} MiB); "
        f"learner idle {summary['learner_idle_fraction']:.2f}, "
        f"rollout idle {summary['rollout_idle_fraction']:.2f}"
    )
    assert summary["steps"] == 6 and summary["restarts"] == {}
    assert not sampler.unbalanced
    assert summary["ledger"]["balanced"] and summary["ledger"]["in_flight"] == 0
    # The queues filled up to the admission limit and no further: rollout was the fast side.
    # Evaluation rounds (one job per eval problem; the base and final rounds here) are bounded
    # apart: admission counts the training lane.
    assert limit // 2 <= sampler.max_in_flight <= limit
    eval_problems = load_config(REPO / "configs" / "tiny.yaml").data.synth.num_eval  # type: ignore[union-attr]
    assert all(depth <= limit + eval_problems for depth in sampler.max_depth.values()), (
        sampler.max_depth
    )
    assert summary["rollout_idle_fraction"] > 0.5
    assert peak < 64 * MIB


def test_slow_rollout_keeps_the_learner_waiting_not_failing(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        proc = start_run(
            tmp_path, server.url, "learner.total_steps=8", faults="rollout.slowdown=10"
        )
        summary = finish(proc, tmp_path)
        metrics = [
            json.loads(f[b"m"])
            for _, f in redis.Redis.from_url(server.url).xrange(Keys("dapo").metrics)
        ]
    # Between its first and last step the learner computed for sum(train_s) seconds; the rest it
    # waited: for kept groups, and in the weight sync for replicas to finish their slow batch.
    span = metrics[-1]["time"] - metrics[0]["time"]
    computing = sum(m["timing_s/update_actor"] for m in metrics[1:]) / span
    print(
        f"slow rollout: the learner computed {computing:.2f} of the time between its first and "
        f"last step (waited the rest); rollout idle {summary['rollout_idle_fraction']:.2f}; "
        f"{summary['wall_seconds']:.0f}s for 8 steps"
    )
    assert summary["steps"] == 8 and summary["restarts"] == {}
    assert summary["ledger"]["balanced"] and summary["ledger"]["in_flight"] == 0
    assert (
        computing < 0.5 and summary["rollout_idle_fraction"] < 0.5
    )  # ~0.8 and ~0.8 at normal speed
    assert summary["counters"].get("weight_sync_failures", 0) == 0


def test_redis_at_maxmemory_pauses_the_run_and_loses_nothing(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        admin = redis.Redis.from_url(server.url)
        bus = StreamBus(connect(server.url, pause_when_full=False), Keys("dapo"), "observer")
        proc = start_run(tmp_path, server.url, "learner.total_steps=16")
        wait_for("step 4", lambda: learner_step(admin) >= 4)
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used // 2)
        filled_at = time.monotonic()
        # Give every service time to run into a refused write; then look at the frozen run.
        time.sleep(12)
        status = run_status(bus, heartbeat_ttl_s=30)
        during = (learner_step(admin), status["ledger"])
        time.sleep(5)
        # Acknowledging trained groups is a hop, which Redis would still accept: if the learner
        # were still training, `trained` would move.
        assert bus.ledger().trained == during[1]["trained"], (
            "the learner kept training while Redis refused writes"
        )
        assert status["instances"], "heartbeats should stay visible while Redis is full"
        admin.config_set("maxmemory", 0)
        paused_s = time.monotonic() - filled_at
        summary = finish(proc, tmp_path)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    print(
        f"maxmemory: paused {paused_s:.0f}s at step {during[0]}; ledger during the pause "
        f"{during[1]}; {summary['counters'].get(OOM_PAUSE_COUNTER, 0)} service pauses counted"
    )
    assert status["redis_memory"]["at_maxmemory"]
    assert during[1]["balanced"]
    assert "Redis is at maxmemory" in logs and "nothing has been dropped" in logs
    assert summary["counters"].get(OOM_PAUSE_COUNTER, 0) >= 1
    assert summary["steps"] == 16 and summary["restarts"] == {}  # paused, not crashed
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["dead"] == 0
    assert summary["counters"].get("trained_twice", 0) == 0
