"""Skipping prompts before generation (`algorithm.prompt_skip`), against a real Redis: the
gatekeeper writes each prompt's history, the feeder reads it and skips a prompt with the
configured probability, never more often than the exploration floor allows, and the history
outlives the learner that read it."""

from __future__ import annotations

import math

import pytest

from contracts.bus import MAX_PROMPTS, StreamBus, connect
from contracts.config import PromptSkipConfig
from contracts.data import PromptRecord
from contracts.keys import Counter, Keys, RunField
from contracts.schemas import PromptJob, Response, ScoredGroup, decode_job, encode_group
from gatekeeper.service import Gatekeeper
from learner.feeder import PromptFeeder, keep_probability

N_PROMPTS = 50


class Chars:
    """A tokenizer stand-in: one id per character."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]


def records(n: int = N_PROMPTS) -> list[PromptRecord]:
    return [
        PromptRecord(
            index=i,
            messages=[{"role": "user", "content": f"{i}+1"}],
            ground_truth=str(i + 1),
            data_source="t",
            extra_info={},
        )
        for i in range(n)
    ]


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("skip"), consumer="learner")
    b.ensure_groups()
    return b


def feeder(
    bus: StreamBus, skip: PromptSkipConfig | None, *, seed: int = 0, limit: int = 10_000
) -> PromptFeeder:
    return PromptFeeder(
        bus,
        records(),
        Chars(),
        run_name="t",
        limit=limit,
        kept_ahead=limit,
        max_prompt_len=16,
        shuffle=False,
        seed=seed,
        skip=skip,
    )


def issued_rows(bus: StreamBus) -> list[int]:
    rows = bus.redis.xrange(bus.keys.prompts.stream)
    return [decode_job(fields).prompt_index for _, fields in rows]


def gate(bus: StreamBus, prompt_index: int, acc: list[bool], *, epoch: int = 0) -> None:
    """One scored group of `prompt_index` through the real gatekeeper."""
    job = PromptJob(
        group_id=f"g-{prompt_index}-{epoch}-{sum(acc)}",
        prompt_index=prompt_index,
        epoch=epoch,
        prompt_ids=[5],
        ground_truth="2",
        issued_version=0,
        issued_at=1.0,
    )
    group = ScoredGroup(
        job=job,
        responses=[Response(token_ids=[1], logprobs=[-0.5], finish_reason="stop")] * len(acc),
        policy_version=0,
        replica_id="r",
        preds=["x"] * len(acc),
        scores=[1.0 if a else -1.0 for a in acc],
        rewards=[1.0 if a else -1.0 for a in acc],
        acc=acc,
    )
    bus.redis.xadd(bus.keys.scored.stream, encode_group(group))
    gatekeeper = Gatekeeper(bus.as_consumer("gatekeeper"))
    gatekeeper.handle(gatekeeper.bus.read(bus.keys.scored, count=10, block_ms=10))


def test_keep_probability_halves_per_streak_and_stops_at_the_floor() -> None:
    skip = PromptSkipConfig(enabled=True, keep_base=0.5, min_keep=0.1)
    assert [keep_probability(s, skip) for s in range(5)] == [1.0, 0.5, 0.25, 0.125, 0.1]
    assert keep_probability(200, skip) == 0.1


def test_the_gatekeeper_records_each_prompts_groups(bus: StreamBus) -> None:
    gate(bus, 3, [True, True, True, True])  # all right: no signal, filtered
    gate(bus, 3, [False] * 4, epoch=1)  # all wrong: no signal
    gate(bus, 7, [True, False, False, False], epoch=1)  # kept
    never, three, seven = bus.prompt_stats([0, 3, 7])
    assert never.seen == 0 and never.pass_rate is None
    assert (three.seen, three.epoch, three.streak, three.kept) == (2, 1, 2, 0)
    assert three.pass_rate == 0.0
    assert (seven.seen, seven.streak, seven.kept, seven.pass_rate) == (1, 0, 1, 0.25)
    gate(bus, 3, [True, False, True, True], epoch=2)  # signal again: the streak restarts
    assert bus.prompt_stats([3])[0].streak == 0
    assert bus.ledger().filtered == 2 and bus.counters()[Counter.GATEKEEPER_KEPT] == 2


def test_a_prompt_out_of_range_is_not_recorded(bus: StreamBus) -> None:
    assert not bus.record_prompt_outcome(MAX_PROMPTS, epoch=0, correct=0, size=4, kept=False)
    assert bus.prompt_history_bytes() == 0 and bus.prompt_stats([MAX_PROMPTS])[0].seen == 0


def test_prompts_without_a_streak_are_never_skipped(bus: StreamBus) -> None:
    for i in range(0, N_PROMPTS, 2):  # half the prompts had signal last time
        bus.record_prompt_outcome(i, epoch=0, correct=1, size=4, kept=True)
    f = feeder(bus, PromptSkipConfig(enabled=True), limit=N_PROMPTS)
    assert f.admit(0) == N_PROMPTS  # one epoch, with no zero-advantage streak anywhere
    assert issued_rows(bus) == list(range(N_PROMPTS)) and f.skipped == 0
    assert f.cursor == N_PROMPTS == f.jobs_issued


def test_a_long_streak_is_skipped_with_the_floors_probability(bus: StreamBus) -> None:
    skip = PromptSkipConfig(enabled=True, keep_base=0.5, min_keep=0.2)
    for i in range(N_PROMPTS):  # 10 zero-advantage groups in a row: 0.5**10 is below the floor
        for _ in range(10):
            bus.record_prompt_outcome(i, epoch=0, correct=0, size=8, kept=False)
    f = feeder(bus, skip)
    assert f.admit(0) == 10_000
    seen = f.cursor  # every position the feeder came to: issued or skipped
    assert bus.run_int(RunField.DATA_CURSOR) == seen  # recorded for a restarted learner
    issued = bus.ledger().issued
    assert issued == 10_000 == f.jobs_issued and f.skipped == seen - issued
    assert bus.counters()[Counter.PROMPTS_SKIPPED] == f.skipped
    # Issued with probability exactly min_keep (binomial, within 5 standard deviations), so
    # skipped with 1 - min_keep: more than keep_base ** 10 would give, never every time.
    p = issued / seen
    assert abs(p - 0.2) < 5 * math.sqrt(0.2 * 0.8 / seen), p


def test_a_streak_of_one_keeps_about_half(bus: StreamBus) -> None:
    for i in range(N_PROMPTS):
        bus.record_prompt_outcome(i, epoch=0, correct=8, size=8, kept=False)
    f = feeder(bus, PromptSkipConfig(enabled=True, keep_base=0.5, min_keep=0.05))
    f.admit(0)
    p = f.jobs_issued / f.cursor
    assert abs(p - 0.5) < 5 * math.sqrt(0.25 / f.cursor), p


def test_skipping_off_issues_every_prompt_whatever_its_history(bus: StreamBus) -> None:
    for i in range(N_PROMPTS):
        for _ in range(10):
            bus.record_prompt_outcome(i, epoch=0, correct=0, size=8, kept=False)
    for skip in (None, PromptSkipConfig(enabled=False)):
        bus.redis.delete(bus.keys.prompts.stream)
        f = feeder(bus, skip, limit=N_PROMPTS)
        assert f.admit(0) == N_PROMPTS and f.skipped == 0
        assert issued_rows(bus) == list(range(N_PROMPTS))


def test_a_restarted_learner_reads_the_same_history_and_decides_the_same(
    bus: StreamBus, redis_url: str
) -> None:
    """The history lives in Redis with the run, not in the learner: a new learner process (a new
    connection and feeder, from the same cursor) skips exactly what the old one would have."""
    for i in range(N_PROMPTS):
        for _ in range(i % 4):
            gate(bus, i, [False] * 4)
    skip = PromptSkipConfig(enabled=True)
    first = feeder(bus, skip, limit=200)
    first.admit(0)
    decided_first = issued_rows(bus)

    bus.redis.delete(bus.keys.prompts.stream, bus.keys.ledger)
    restarted = StreamBus(connect(redis_url), Keys("skip"), consumer="learner-2")
    restarted.ensure_groups()
    second = feeder(restarted, skip, limit=200)
    second.admit(0)
    assert issued_rows(restarted) == decided_first and second.cursor == first.cursor
    assert 0 < first.skipped == second.skipped
    # Streaks 0..3 in turn: only prompts with a streak were passed over.
    issued = set(decided_first[:N_PROMPTS])
    assert {i for i in range(N_PROMPTS) if i % 4 == 0} <= issued


def test_jobs_carry_their_epoch_and_a_budget_counts_issued_jobs_only(bus: StreamBus) -> None:
    for i in range(N_PROMPTS):
        for _ in range(3):
            bus.record_prompt_outcome(i, epoch=0, correct=0, size=8, kept=False)
    f = feeder(bus, PromptSkipConfig(enabled=True, keep_base=0.5, min_keep=0.1))
    f.max_jobs = 30
    assert f.admit(0) == 30 and f.admit(0) == 0
    assert bus.ledger().issued == 30 < f.cursor
    jobs = [decode_job(fields) for _, fields in bus.redis.xrange(bus.keys.prompts.stream)]
    assert [j.epoch for j in jobs] == [cursor // N_PROMPTS for cursor in cursors(jobs)]
    assert max(j.epoch for j in jobs) >= 1  # 30 of 50 at 1/8 each: several passes


def cursors(jobs: list[PromptJob]) -> list[int]:
    return [int(j.group_id.rsplit("-", 1)[1]) for j in jobs]


def test_a_planted_value_where_the_history_belongs_is_skipped_and_replaced(
    bus: StreamBus,
) -> None:
    bus.redis.hset(bus.keys.prompt_history, "x", "1")
    assert all(s.seen == 0 for s in bus.prompt_stats([0, 1]))
    assert bus.counters()[Counter.BAD_REDIS_VALUES] >= 1
    assert bus.record_prompt_outcome(1, epoch=0, correct=0, size=4, kept=False)
    assert bus.prompt_stats([1])[0].streak == 1
