"""Per-task figures (issue 42) against a real Redis: the gatekeeper counts every decided training
group under its task (kept and filtered ones, evaluation groups never), the learner reports each
task's accuracy, pass rate and response length over what was decided since its last step, the
evaluation lane each task's accuracy per round, and the run keeps the per-task history."""

from __future__ import annotations

import pytest

from contracts.bus import StreamBus, connect
from contracts.keys import Keys
from contracts.schemas import PromptJob, Response, ScoredGroup, decode_job, encode_group
from contracts.tasks import MAX_TASKS, OTHER_TASK, TaskStats
from gatekeeper.service import Gatekeeper
from learner.commands import Progress
from learner.evaluation import EvalLane
from learner.report import RunReporter
from learner.tracking import Completion
from tests.helpers import gatekeeper_on


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("tasks"), consumer="learner-a")
    b.ensure_groups()
    b.set_policy_version(5)
    return b


def group(task: str, acc: list[bool], *, length: int = 3, n: int = 0) -> ScoredGroup:
    job = PromptJob(
        group_id=f"run-{task}-{n}",
        prompt_index=n,
        prompt_ids=[1, 2],
        ground_truth="1",
        data_source=task,
        issued_version=0,
        issued_at=0.0,
    )
    responses = [
        Response(token_ids=[7] * length, logprobs=[-1.0] * length, finish_reason="stop")
        for _ in acc
    ]
    scores = [1.0 if a else -1.0 for a in acc]
    return ScoredGroup(
        job=job,
        policy_version=0,
        replica_id="r0",
        responses=responses,
        scores=scores,
        acc=acc,
        rewards=scores,
        preds=[""] * len(acc),
    )


def gate(bus: StreamBus, groups: list[ScoredGroup]) -> Gatekeeper:
    """Issue the groups' jobs, put the groups on the scored stream, let a gatekeeper decide."""
    bus.issue([encode_group(g) for g in groups])  # counted issued, as the feeder would
    replica = bus.as_consumer("replica")
    for (entry_id, _), g in zip(
        replica.read(bus.keys.prompts, count=100, block_ms=None), groups, strict=True
    ):
        replica.hop(
            bus.keys.prompts, entry_id, downstream=bus.keys.scored.stream, fields=encode_group(g)
        )
    keeper = gatekeeper_on(bus.as_consumer("gatekeeper"))
    keeper.handle(keeper.transport.read(bus.keys.scored, count=100, block_ms=None))
    return keeper


class Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, metrics))

    def log_completions(self, step: int, completions: list[Completion]) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_gatekeeper_counts_each_task_and_the_learner_reports_each_step(
    bus: StreamBus,
) -> None:
    reporter = RunReporter(Recorder(), transport=bus, run_state=bus, telemetry=bus)
    keeper = gate(
        bus,
        [
            group("chain_sum", [True, False, False, False], length=4, n=0),  # kept
            group("chain_sum", [False] * 4, length=2, n=1),  # filtered: all wrong
            group("openai/gsm8k", [True] * 2, length=10, n=2),  # filtered: all right
        ],
    )
    assert (keeper.kept, keeper.filtered) == (1, 2)
    assert keeper.status()["task_pass_rate"] == {"chain_sum": 0.5, "openai_gsm8k": 0.0}
    assert bus.task_stats() == {
        "chain_sum": TaskStats(kept=1, filtered=1, correct=1, responses=8, tokens=24),
        "openai_gsm8k": TaskStats(filtered=1, correct=2, responses=2, tokens=20),
    }
    first = reporter.rollout_metrics([], trained_on=0)
    assert first["task/chain_sum/accuracy"] == pytest.approx(1 / 8)  # filtered groups count
    assert first["task/chain_sum/pass_rate"] == 0.5
    assert first["task/chain_sum/response_length"] == 3.0
    assert first["task/openai_gsm8k/accuracy"] == 1.0

    gate(bus, [group("chain_sum", [True, True, False, True], length=6, n=3)])
    second = reporter.rollout_metrics([], trained_on=1)
    assert second["task/chain_sum/accuracy"] == 0.75  # this step's groups only
    assert second["task/chain_sum/pass_rate"] == 1.0
    assert not any(key.startswith("task/openai_gsm8k/") for key in second)  # nothing new


def test_a_reporter_started_mid_run_reports_only_what_comes_after(bus: StreamBus) -> None:
    gate(bus, [group("a", [True, False], n=0)])
    reporter = RunReporter(Recorder(), transport=bus, run_state=bus, telemetry=bus)  # restarted
    gate(bus, [group("a", [False, False], n=1)])
    assert reporter.rollout_metrics([], trained_on=0)["task/a/accuracy"] == 0.0


def test_tasks_past_the_limit_are_counted_together(bus: StreamBus) -> None:
    for i in range(MAX_TASKS):
        bus.count_task(f"t{i}", TaskStats(kept=1))
    gate(bus, [group("t0", [True, False], n=0), group("new", [True, False], n=1)])
    stats = bus.task_stats()
    assert len(stats) == MAX_TASKS + 1 and stats["t0"].kept == 2
    assert stats[OTHER_TASK] == TaskStats(kept=1, correct=1, responses=2, tokens=6)


def test_evaluation_groups_are_not_counted_and_each_round_has_per_task_accuracy(
    bus: StreamBus,
) -> None:
    problems = [([1], "5", "chain_sum"), ([2], "9", "chain_sum"), ([3], "x", "spell_backward")]
    lane = EvalLane(
        problems,
        transport=bus,
        run_state=bus,
        run_name="run",
        samples=2,
        max_deliveries=3,
        catch_up=lambda: None,
    )
    reporter = RunReporter(Recorder(), transport=bus, run_state=bus, telemetry=bus)
    lane.issue(Progress(step=4, policy_version=5), 1.0)
    replica = bus.as_consumer("replica")
    correct = {0: [True, True], 1: [True, False], 2: [False, False]}
    for entry_id, fields in replica.read(bus.keys.prompts, count=10, block_ms=None):
        job = decode_job(fields)
        assert job.eval is not None
        scored = group(job.data_source, correct[job.eval.problem]).model_copy(update={"job": job})
        replica.hop(
            bus.keys.prompts,
            entry_id,
            downstream=bus.keys.scored.stream,
            fields=encode_group(scored),
        )
    keeper = gatekeeper_on(bus.as_consumer("gatekeeper"))
    keeper.handle(keeper.transport.read(bus.keys.scored, count=10, block_ms=None))
    assert keeper.evaluations == 3 and bus.task_stats() == {}  # the training lane's only
    [(step, metrics)] = lane.poll()
    assert metrics["task/chain_sum/eval_acc"] == 0.75
    assert metrics["task/spell_backward/eval_acc"] == 0.0
    assert metrics["eval/acc"] == pytest.approx(3 / 6)
    reporter.record_eval(step, metrics)
    assert bus.task_eval_history() == [(4, {"chain_sum": 0.75, "spell_backward": 0.0})]
