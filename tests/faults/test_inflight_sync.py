"""In-flight weight updates (real processes, a real Redis): with the rollout 10x slower and
responses near the length limit (the tiny model answers in 6-7 tokens; the limit is 8),
replicas take each broadcast between two decode steps instead of after their batch, so the
learner's sync costs a transfer plus the replicas' reaction, not a generation.

Measured against a bare gloo broadcast of the same bytes to the same number of receivers, on
the same machine, during the run; run with `-s` to see the figures."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import redis
from safetensors import safe_open

from contracts.bus import StreamBus, connect
from contracts.config import load_config
from contracts.keys import Keys
from contracts.weight_sync import flat_broadcast_seconds
from tests.helpers import REPO, finish, learner_step, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def weight_bytes(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118


def test_a_slow_rollout_does_not_slow_the_weight_sync(tmp_path: Path, redis_url: str) -> None:
    steps = 20  # the first steps form the weight-sync group; the median is over the rest
    proc = start_run(
        tmp_path,
        redis_url,
        f"learner.total_steps={steps}",
        "rollout.max_response_len=8",
        "reward.overlong.buffer_len=2",
        faults="rollout.slowdown=10",
    )
    # The reference transfer is measured in the same run: while it trains, with the same machine
    # load, the same bytes from one process to as many receiving processes as there are replicas.
    wait_for("step 5", lambda: learner_step(redis.Redis.from_url(redis_url)) >= 5, timeout_s=600)
    model = (
        REPO / load_config(REPO / "configs" / "tiny.yaml").model.path
    )  # the weights this run broadcasts
    flat = flat_broadcast_seconds(weight_bytes(model), replicas=2, repeats=9)
    summary = finish(proc, tmp_path)
    assert summary["steps"] == steps and summary["ledger"]["balanced"]
    metrics = StreamBus(connect(redis_url), Keys("dapo"), "test").recent_metrics()
    syncs = [m["timing_s/sync_weights"] for m in metrics]
    gen_per_group = statistics.median(m["timing_s/gen_per_group"] for m in metrics)
    in_flight = sum(m["rollout/updated_in_flight"] for m in metrics) / len(metrics)
    length = sum(m["response_length/mean"] for m in metrics) / len(metrics)
    mean_sync, median_sync = sum(syncs) / len(syncs), statistics.median(syncs)
    print(
        f"\nsync: median {median_sync * 1e3:.1f} ms, mean {mean_sync * 1e3:.1f} ms (max "
        f"{max(syncs) * 1e3:.1f}: forming the group) vs a bare broadcast of the same bytes "
        f"{flat * 1e3:.1f} ms ({median_sync / flat:.1f}x); one group's share of a generation "
        f"batch {gen_per_group * 1e3:.1f} ms; responses updated in flight {in_flight:.0%}, mean "
        f"length {length:.1f} of at most 8 tokens"
    )
    assert in_flight > 0.05, "no response was generated across a weight update"
    # The mechanism, not a speed: a learner that waited for the replicas to finish their batch
    # would spend a whole generation batch (several groups' worth) in every sync. Taking the
    # broadcast between two decode steps costs a transfer plus the replicas' wake-up: measured
    # 1.6-3x the bare broadcast here (median; 5-7 ms against 2-4 ms), which is a figure for the
    # printout above and for bench/, not a bound to assert on a shared 2-core machine (a 2.5x
    # bound failed once on scheduling noise). Less than one group's share of a batch holds with
    # a wide margin and fails as soon as a sync waits for generation.
    assert median_sync < gen_per_group, (
        f"median sync {median_sync:.4f}s >= one group's generation {gen_per_group:.4f}s: the "
        "learner waited for the replicas' batches"
    )
