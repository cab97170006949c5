"""The evaluation lane against a real Redis: rounds travel the prompt stream as flagged jobs, the
gatekeeper never trains or filters them, the learner adds each round up once it is complete (also
after a restart, and with jobs lost to the dead-letter stream), and the ledger's two lanes balance.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.bus import StreamBus, connect
from contracts.data import PromptRecord
from contracts.eval_stats import read_rounds
from contracts.heldout import distinct_problems
from contracts.keys import Counter, Keys
from contracts.schemas import EvalResult, Response, ScoredGroup, decode_job, encode_group
from learner.commands import Progress
from learner.evaluation import EvalLane
from tests.helpers import gatekeeper_on

PROBLEMS = [([1, 2, 3], "5", "synth"), ([4, 5], "9", "synth"), ([6], "1", "synth")]
SAMPLES = 4


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("t"), consumer="learner-a")
    b.ensure_groups()
    b.set_policy_version(20)  # past every group's version: the gatekeeper refuses newer ones
    return b


def lane(bus: StreamBus, **kw: object) -> EvalLane:
    args = {
        "run_name": "run",
        "samples": SAMPLES,
        "max_deliveries": 3,
        "catch_up": lambda: None,
        **kw,
    }
    return EvalLane(PROBLEMS, transport=bus, run_state=bus, **args)  # type: ignore[arg-type]


def serve(
    bus: StreamBus, correct: dict[int, int], *, version: int = 0, only: set[int] | None = None
) -> None:
    """Replica, reward worker and gatekeeper for the evaluation jobs waiting: problem i gets
    `correct[i]` of its samples right."""
    replica, keys = bus.as_consumer("replica"), bus.keys
    for entry_id, fields in replica.read(keys.prompts, count=100, block_ms=None):
        job = decode_job(fields)
        assert job.eval is not None and job.eval.samples == SAMPLES
        if only is not None and job.eval.problem not in only:
            replica.hand_back(keys.prompts, entry_id, fields)
            continue
        ok = correct[job.eval.problem]
        group = ScoredGroup(
            job=job,
            policy_version=version,
            replica_id="r0",
            responses=[
                Response(token_ids=[7] * (i + 1), logprobs=[-1.0] * (i + 1), finish_reason="stop")
                for i in range(SAMPLES)
            ],
            scores=[1.0 if i < ok else -1.0 for i in range(SAMPLES)],
            acc=[i < ok for i in range(SAMPLES)],
            rewards=[1.0 if i < ok else -1.0 for i in range(SAMPLES)],
            preds=[""] * SAMPLES,
        )
        replica.hop(
            keys.prompts, entry_id, downstream=keys.scored.stream, fields=encode_group(group)
        )
    gate = gatekeeper_on(bus.as_consumer("gatekeeper"))
    gate.handle(gate.transport.read(keys.scored, count=100, block_ms=None))
    assert (
        gate.kept == 0 and gate.filtered == 0
    )  # evaluation groups are never gated (all-correct ones neither)


def test_a_round_is_reported_once_every_problem_is_in_and_never_trained(bus: StreamBus) -> None:
    evals = lane(bus)
    evals.issue(Progress(step=10, policy_version=12), 12.5)
    snap = bus.ledger()
    assert (snap.issued, snap.eval_issued, snap.eval_in_flight, snap.train_in_flight) == (
        0,
        3,
        3,
        0,
    )
    assert evals.in_flight

    serve(bus, {0: 4, 1: 1, 2: 0}, version=13, only={0, 1})
    assert evals.poll() == []  # problem 2 still generating
    serve(bus, {2: 0}, version=12)
    [(step, metrics)] = evals.poll()
    assert step == 10
    assert metrics["eval/acc"] == pytest.approx(5 / 12)  # avg@4 over the 3 problems
    assert metrics["eval/response_length"] == pytest.approx(2.5) and metrics["eval/problems"] == 3
    assert metrics["eval/samples_per_problem"] == 4 and metrics["eval/policy_version_lag"] == 1
    assert metrics["eval/rl_seconds"] == 12.5  # when the evaluated weights existed
    snap = bus.ledger()
    assert (snap.evaluated, snap.in_flight, snap.trained, snap.filtered, snap.balanced) == (
        3,
        0,
        0,
        0,
        True,
    )
    assert bus.depths()["learner"] == 0 and bus.counters().get(Counter.GATEKEEPER_KEPT, 0) == 0
    assert not evals.in_flight and evals.poll() == []


def test_a_round_is_credited_to_the_version_that_produced_it(
    bus: StreamBus, tmp_path: Path
) -> None:
    rounds = tmp_path / "eval_rounds.jsonl"
    rounds.write_text('{"an earlier run": 1}\n')
    evals = lane(bus, rounds_path=rounds)
    assert not rounds.exists()  # no round of this run reported yet: the old file is gone
    evals.published(Progress(step=10, policy_version=12), 12.5)
    evals.issue(Progress(step=10, policy_version=12), 12.5)
    evals.published(Progress(step=11, policy_version=13), 14.0)
    # The replica reached the round's jobs holding version 13 (they queued behind training).
    serve(bus, {0: 4, 1: 1, 2: 0}, version=13)
    [(step, metrics)] = evals.poll()
    assert step == 11 and metrics["eval/step"] == 11 and metrics["eval/issued_step"] == 10
    assert metrics["eval/rl_seconds"] == 14.0 and metrics["eval/policy_version"] == 13
    assert metrics["eval/credited_at_issue"] == 0
    assert metrics["eval/acc_ci_low"] <= metrics["eval/acc"] <= metrics["eval/acc_ci_high"]
    assert metrics["eval/acc_ci_low"] < metrics["eval/acc_ci_high"]
    [record] = read_rounds(rounds)
    assert (record.step, record.rl_seconds, record.policy_version) == (11, 14.0, 13)
    assert record.per_problem == (1.0, 0.25, 0.0) and record.extra["issued_step"] == 10


def test_a_restarted_learner_takes_over_a_half_added_round(bus: StreamBus) -> None:
    first = lane(bus)
    first.issue(Progress(step=0, policy_version=0), 0.0)
    serve(bus, {0: 2, 1: 2, 2: 2}, only={0, 1})
    assert first.poll() == []  # two results held, unacknowledged
    # The learner dies; its successor (another consumer) finishes the round.
    second = lane(bus.as_consumer("learner-b"))
    assert second.in_flight  # so the loop does not issue the base round again
    serve(bus, {2: 2})
    [(step, metrics)] = second.poll()
    assert step == 0 and metrics["eval/acc"] == pytest.approx(0.5) and metrics["eval/problems"] == 3
    assert "eval/seconds" not in metrics  # issued by another process
    assert bus.ledger().balanced and bus.ledger().in_flight == 0


def test_a_round_that_lost_a_job_is_reported_when_the_lane_is_quiet(bus: StreamBus) -> None:
    evals = lane(bus)
    evals.issue(Progress(step=5, policy_version=5), 0.0)
    replica = bus.as_consumer("replica")
    entry_id, fields = next(
        (e, f) for e, f in replica.read(bus.keys.prompts, count=1, block_ms=None)
    )
    replica.dead_letter(bus.keys.prompts, entry_id, fields, "rollout: test")
    serve(bus, {0: 4, 1: 4, 2: 4})
    [(step, metrics)] = evals.poll()
    assert step == 5 and metrics["eval/problems"] == 2 and metrics["eval/acc"] == 1.0
    snap = bus.ledger()
    assert (snap.eval_dead, snap.evaluated, snap.dead, snap.balanced, snap.in_flight) == (
        1,
        2,
        0,
        True,
        0,
    )


def test_a_round_is_issued_once_per_policy_version(bus: StreamBus) -> None:
    evals = lane(bus)
    evals.issue(Progress(step=3, policy_version=3), 0.0)
    evals.issue(Progress(step=3, policy_version=3), 0.0)
    assert bus.ledger().eval_issued == 3
    serve(bus, {0: 1, 1: 1, 2: 1})
    assert [step for step, _ in evals.poll()] == [3]
    evals.issue(Progress(step=3, policy_version=3), 0.0)  # reported already
    evals.issue(
        Progress(step=3, policy_version=7), 0.0
    )  # the same step retrained after a resume: new weights
    assert bus.ledger().eval_issued == 6


def test_the_result_message_counts_what_avg_at_k_needs() -> None:
    group = ScoredGroup(
        job={
            "group_id": "e",
            "prompt_index": 0,
            "prompt_ids": [1],
            "ground_truth": "1",
            "issued_version": 2,
            "issued_at": 0.0,
            "eval": {
                "round_step": 2,
                "policy_version": 2,
                "problem": 0,
                "problems": 1,
                "samples": 2,
            },
        },
        policy_version=3,
        replica_id="r",
        acc=[True, False],
        scores=[1.0, -1.0],
        rewards=[1.0, -1.0],
        preds=["", ""],
        responses=[
            Response(token_ids=[1, 2], logprobs=[0.0, 0.0], finish_reason="stop"),
            Response(token_ids=[1, 2, 3], logprobs=[0.0] * 3, finish_reason="length"),
        ],
    )
    result = EvalResult.of(group)
    assert (
        result.correct,
        result.samples,
        result.response_tokens,
        result.truncated,
        result.policy_version,
    ) == (1, 2, 5, 1, 3)


def test_duplicate_problems_in_an_eval_file_are_merged() -> None:
    def rec(i: int, text: str, truth: str) -> PromptRecord:
        return PromptRecord(
            index=i,
            messages=[{"role": "user", "content": text}],
            ground_truth=truth,
            data_source="aime",
            extra_info={},
        )

    records = [
        rec(i, f"problem {i % 3}", str(i % 3)) for i in range(96)
    ]  # AIME-style: 3 problems x 32 rows
    assert [r.index for r in distinct_problems(records)] == [0, 1, 2]
