"""The rollout replica's loop against a real Redis, with a stand-in engine (no model): a batch
that outlasts `queue.claim_idle_s` keeps its claims, so another replica does not take it over
and generate it a second time."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from contracts.bus import StreamBus, connect
from contracts.config import load_config
from contracts.keys import Keys
from contracts.runtime import StopFlag
from contracts.schemas import EvalTag, PromptJob, decode_group, encode_job
from rollout import service
from rollout.sample import Sample
from rollout.seeds import eval_seeds
from rollout.service import RolloutReplica
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]


class SlowEngine:
    """Takes `seconds` per batch (a GPU batch of long responses) and records the prompts it
    generated for."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.prompts: list[list[int]] = []
        self.generating = threading.Event()

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seeds: object = None,
        between_steps: object = None,
        stop: object = (),
    ) -> list[list[Sample]]:
        self.prompts += prompts
        self.generating.set()
        time.sleep(self.seconds)
        return [
            [
                Sample(token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="stop")
                for _ in range(n)
            ]
            for _ in prompts
        ]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise AssertionError("no weights are published in this test")

    def load_weights_from_dir(self, path: str) -> None:
        raise AssertionError("no checkpoint exists in this test")

    def close(self) -> None:
        pass


def test_a_replica_keeps_the_claim_on_a_batch_that_outlasts_the_claim_timeout(
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The other replica looks for abandoned jobs every 50 ms instead of every 5 s.
    monkeypatch.setattr(service, "RECLAIM_EVERY_S", 0.05)
    monkeypatch.setattr(service, "IDLE_WAIT_S", 0.05)
    cfg = load_config(
        REPO / "configs" / "tiny.yaml", [f"output_dir={tmp_path}", "queue.claim_idle_s=0.5"]
    )
    bus = StreamBus(connect(redis_url), Keys("rollout-claims"), consumer="test")
    bus.ensure_groups()
    job = PromptJob(
        group_id="g0",
        prompt_index=0,
        prompt_ids=[5, 6],
        ground_truth="1",
        issued_at=time.time(),
        issued_version=0,
    )
    bus.issue([encode_job(job)])

    replicas: dict[str, tuple[RolloutReplica, SlowEngine, threading.Thread]] = {}
    stop = StopFlag()

    def start(name: str) -> SlowEngine:
        engine = SlowEngine(seconds=1.5)  # three claim timeouts
        worker = RolloutReplica(
            cfg,
            engine,
            name,
            stop,
            transport=bus.as_consumer(name),
            run_state=bus.as_consumer(name),
        )
        thread = threading.Thread(target=worker.run, name=name, daemon=True)
        thread.start()
        replicas[name] = (worker, engine, thread)
        return engine

    slow = start("slow")
    assert slow.generating.wait(30)
    reclaimer = start("reclaimer")  # starts while the slow replica generates, reclaiming at once
    try:
        wait_for(
            "the slow replica's group",
            lambda: bus.redis.xlen(bus.keys.rollouts.stream),
            timeout_s=30,
            every_s=0.05,
        )
        time.sleep(0.3)  # the reclaimer keeps looking after the hop: nothing is left to take
    finally:
        stop.event.set()
        for worker, _, thread in replicas.values():
            thread.join(timeout=10)
            if worker.weights._watcher is not None:
                worker.weights._watcher.join(timeout=10)

    assert (
        slow.prompts == [[5, 6]] and reclaimer.prompts == []
    )  # generated once, by the replica that took it
    [(_, fields)] = bus.redis.xrange(bus.keys.rollouts.stream)
    assert decode_group(fields).replica_id == "slow"
    assert [replicas[name][0].groups_done for name in ("slow", "reclaimer")] == [1, 0]
    assert bus.redis.xpending(bus.keys.prompts.stream, bus.keys.prompts.group)["pending"] == 0
    assert not any(thread.is_alive() for _, _, thread in replicas.values())


class RecordingEngine(SlowEngine):
    """Receives broadcasts in the background (as the transformers engine does) and records the
    seeds each batch was given."""

    receives_on_host = True

    def __init__(self) -> None:
        super().__init__(seconds=0.0)
        self.seeds: list[object] = []

    def generate(self, prompts: list[list[int]], **kw: object) -> list[list[Sample]]:  # type: ignore[override]
        self.seeds.append(kw.get("seeds"))
        return super().generate(prompts, **kw)  # type: ignore[arg-type]


def _eval_job(problem: int) -> PromptJob:
    return PromptJob(
        group_id=f"eval-{problem}",
        prompt_index=problem,
        prompt_ids=[5, 6 + problem],
        ground_truth="1",
        issued_at=time.time(),
        issued_version=0,
        eval=EvalTag(round_step=0, policy_version=0, problem=problem, problems=3, samples=2),
    )


def test_a_round_is_seeded_by_problem_and_held_at_one_version(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evaluation jobs get their problems' seeds (`eval_seeds`), training jobs none; while
    consecutive batches hold evaluation jobs the replica applies no new weights, and it syncs
    again once a batch holds none, or nothing is left to read."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"output_dir={tmp_path}", "eval.seed=7"])
    bus = StreamBus(connect(redis_url), Keys("rollout-hold"), consumer="test")
    bus.ensure_groups()
    engine = RecordingEngine()
    worker = RolloutReplica(
        cfg, engine, "r", StopFlag(), transport=bus.as_consumer("r"), run_state=bus.as_consumer("r")
    )
    assert worker.weights.background
    syncs: list[int] = []
    monkeypatch.setattr(worker.weights, "sync", lambda: syncs.append(1))
    monkeypatch.setattr(worker.weights, "wait_for", lambda version: True)
    train = PromptJob(
        group_id="t0", prompt_index=0, prompt_ids=[9], ground_truth="1", issued_at=0.0,
        issued_version=0,
    )  # fmt: skip
    bus.issue([encode_job(_eval_job(0)), encode_job(_eval_job(1)), encode_job(_eval_job(2))],
              evaluation=True)  # fmt: skip
    bus.issue([encode_job(train)])
    bus.issue([encode_job(_eval_job(0))], evaluation=True)

    def batch(count: int) -> list:  # type: ignore[type-arg]
        return worker.transport.read(bus.keys.prompts, count=count, block_ms=None)

    worker._sync_before_read()
    assert len(syncs) == 1
    worker.handle(batch(2))  # the round's first batch
    assert engine.seeds == [[eval_seeds(7, 0, 2), eval_seeds(7, 1, 2)]]
    worker._sync_before_read()
    assert len(syncs) == 1  # more of the round may follow: the weights stay
    worker.handle(batch(1))
    worker._sync_before_read()
    assert len(syncs) == 1
    worker.handle(batch(1))  # a training job: the round is over for this replica
    assert engine.seeds[-1] is None  # training samples from the replica's own generator
    worker._sync_before_read()
    assert len(syncs) == 2
    worker.handle(batch(1))
    worker._wait_for_activity()  # nothing left to read: the round is over too
    worker._sync_before_read()
    assert len(syncs) == 3


class StoppingEngine(RecordingEngine):
    """Every sample ends at a `rollout.stop` string, as an engine reports it."""

    def generate(self, prompts: list[list[int]], **kw: object) -> list[list[Sample]]:  # type: ignore[override]
        self.stops = kw.get("stop")
        groups = super().generate(prompts, **kw)
        for group in groups:
            for s in group:
                s.finish_reason = "stop_string"
        return groups


def test_rollout_stop_reaches_the_engine_and_ends_a_response_as_stop(
    redis_url: str, tmp_path: Path
) -> None:
    """A completer's answer ends at a newline (`rollout.stop`): the engine is told, and the
    response records "stop", as at an end token (the schema knows no other complete ending)."""
    cfg = load_config(
        REPO / "configs" / "tiny.yaml", [f"output_dir={tmp_path}", 'rollout.stop=["\\n"]']
    )
    bus = StreamBus(connect(redis_url), Keys("rollout-stop"), consumer="test")
    bus.ensure_groups()
    engine = StoppingEngine()
    worker = RolloutReplica(
        cfg, engine, "r", StopFlag(), transport=bus.as_consumer("r"), run_state=bus.as_consumer("r")
    )
    job = PromptJob(
        group_id="t0", prompt_index=0, prompt_ids=[9], ground_truth="1", issued_at=0.0,
        issued_version=0,
    )  # fmt: skip
    bus.issue([encode_job(job)])
    worker.handle(worker.transport.read(bus.keys.prompts, count=1, block_ms=None))
    assert engine.stops == ("\n",)
    [(_, fields)] = bus.redis.xrange(bus.keys.rollouts.stream)
    assert {r.finish_reason for r in decode_group(fields).responses} == {"stop"}


def test_a_job_at_a_version_never_published_is_dead_lettered_not_waited_for(
    redis_url: str, tmp_path: Path
) -> None:
    """A job claims `issued_version` 2**30 while the learner has published 3: a replica would
    wait for that version for ever. It is dead-lettered with the reason; the job beside it at
    the published version is generated."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"output_dir={tmp_path}"])
    bus = StreamBus(connect(redis_url), Keys("rollout-future"), consumer="test")
    bus.ensure_groups()
    bus.set_policy_version(3)
    engine = RecordingEngine()
    worker = RolloutReplica(
        cfg, engine, "r", StopFlag(), transport=bus.as_consumer("r"), run_state=bus.as_consumer("r")
    )
    worker.weights.policy_version = 3  # holds the published weights
    jobs = [
        PromptJob(
            group_id=gid,
            prompt_index=0,
            prompt_ids=[9],
            ground_truth="1",
            issued_at=0.0,
            issued_version=version,
        )
        for gid, version in (("planted", 2**30), ("t0", 3))
    ]
    bus.issue([encode_job(job) for job in jobs])
    worker.handle(worker.transport.read(bus.keys.prompts, count=2, block_ms=None))
    [(_, generated)] = bus.redis.xrange(bus.keys.rollouts.stream)
    assert decode_group(generated).job.group_id == "t0"
    [(_, dead)] = bus.redis.xrange(bus.keys.dead)
    assert dead[b"group_id"] == b"planted"
    assert b"issued at version 1073741824, past the published 3" in dead[b"reason"]
