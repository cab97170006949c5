"""Which kept groups the learner trains, and how many jobs a sample budget issues. Against a real
Redis: jobs are issued and counted in the ledger, and each one ends as a kept group on the train
stream, a filtered group, or stays in flight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from contracts.bus import StreamBus, connect
from contracts.data import PromptRecord
from contracts.keys import LEDGER_FILTERED, Keys
from contracts.runtime import StopFlag
from contracts.schemas import PromptJob, Response, ScoredGroup, encode_group, encode_job
from learner.collect import StreamSource
from learner.commands import Picked
from learner.feeder import PromptFeeder, budget_jobs

RECORD = PromptRecord(
    index=0,
    messages=[{"role": "user", "content": "1+1"}],
    ground_truth="2",
    data_source="t",
    extra_info={},
)


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("collect"), consumer="learner")
    b.ensure_groups()
    return b


def source(bus: StreamBus, *, max_staleness: int, batch_groups: int) -> StreamSource:
    """The learner's collector, with a feeder that issues nothing itself (`kept_ahead=0`)."""
    feeder = PromptFeeder(
        [RECORD],
        None,
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
        run_name="t",
        limit=0,
        kept_ahead=0,
        max_prompt_len=16,
        shuffle=False,
        seed=0,
    )
    return StreamSource(
        feeder,
        transport=bus,
        run_state=bus,
        batch_groups=batch_groups,
        max_staleness=max_staleness,
        max_deliveries=3,
        stop=StopFlag(),
        catch_up=lambda: None,
        vocab_size=100,
        budget_s=0.5,
    )


def job(i: int) -> PromptJob:
    """The i-th job the feeder issues (its group id ends with the data cursor)."""
    return PromptJob(
        group_id=f"t-{i}",
        prompt_index=0,
        prompt_ids=[5, 6],
        ground_truth="2",
        issued_version=0,
        issued_at=100.0 + i,
    )


def issue(bus: StreamBus, n: int) -> dict[str, str]:
    """Issue jobs t-0 .. t-(n-1) in that order and take them as a replica would: group id ->
    entry id."""
    assert bus.issue([encode_job(job(i)) for i in range(n)]) == n
    taken = bus.as_consumer("replica").read(bus.keys.prompts, count=n, block_ms=10)
    return {f[b"group_id"].decode(): eid for eid, f in taken}


def finish(
    bus: StreamBus, entries: dict[str, str], i: int, *, length: int, kept: bool = True
) -> None:
    """The job's group comes back kept (on the train stream), or is filtered."""
    replica = bus.as_consumer("replica")
    entry = entries[f"t-{i}"]
    if not kept:
        assert replica.hop(bus.keys.prompts, entry, outcome=LEDGER_FILTERED)
        return
    responses = [
        Response(token_ids=[7] * length, logprobs=[-0.5] * length, finish_reason="stop")
        for _ in range(2)
    ]
    group = ScoredGroup(
        job=job(i),
        policy_version=0,
        replica_id="r",
        responses=responses,
        rewards=[1.0, -1.0],
        scores=[1.0, -1.0],
        acc=[True, False],
        preds=["2", "3"],
    )
    assert replica.hop(
        bus.keys.prompts, entry, downstream=bus.keys.train.stream, fields=encode_group(group)
    )


def ids(picked: list[Picked] | None) -> list[str] | None:
    return None if picked is None else [p.group.job.group_id for p in picked]


def test_synchronous_mode_trains_the_first_issued_groups_not_the_first_to_finish(
    bus: StreamBus,
) -> None:
    """max_staleness 0: short responses of later prompts finish first; the batch still holds the
    earliest-issued kept groups (verl's DAPO truncates in prompt order), so the source waits
    while earlier jobs are in flight, and a filtered one is simply passed over."""
    src = source(bus, max_staleness=0, batch_groups=2)
    entries = issue(bus, 4)
    finish(bus, entries, 3, length=1)
    finish(bus, entries, 2, length=2)
    assert src.collect(policy_version=0) is None  # t-0 and t-1 may still come back kept
    finish(bus, entries, 1, length=9)
    assert src.collect(policy_version=0) is None  # t-0 too
    finish(bus, entries, 0, length=0, kept=False)
    assert ids(src.collect(policy_version=0)) == ["t-1", "t-2"]
    assert ids(src.pending) == ["t-3"]


def test_asynchronous_mode_trains_the_first_groups_to_arrive(bus: StreamBus) -> None:
    """max_staleness 1: no waiting for earlier jobs; the first kept groups in hand are the batch."""
    src = source(bus, max_staleness=1, batch_groups=2)
    entries = issue(bus, 4)
    finish(bus, entries, 3, length=1)
    finish(bus, entries, 2, length=2)
    assert ids(src.collect(policy_version=0)) == ["t-3", "t-2"]


def test_a_sample_budget_issues_exactly_its_jobs_however_admission_batches_them(
    bus: StreamBus,
) -> None:
    """30 responses of groups of 4: 8 jobs (the fewest that reach it), and no more however large
    the admission that crosses it; a budget that divides is spent to the response."""
    assert budget_jobs(30, 4) == 8 and budget_jobs(32, 4) == 8 and budget_jobs(None, 4) is None
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [5, 6])
    feeder = PromptFeeder(
        [RECORD],
        tokenizer,
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
        run_name="t",
        limit=100,
        kept_ahead=5,
        max_prompt_len=16,
        shuffle=False,
        seed=0,
        max_jobs=budget_jobs(30, 4),
    )
    assert feeder.admit(policy_version=0) == 5  # admission control alone would allow 5 at a time
    feeder.kept_ahead = 10
    assert feeder.admit(policy_version=0) == 3  # trimmed: 8 in all, not 10
    feeder.kept_ahead = 100
    assert feeder.admit(policy_version=0) == 0
    assert feeder.cursor == bus.ledger().issued == 8
