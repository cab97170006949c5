"""Skipping prompts before generation (`algorithm.prompt_skip`): the rule and its adaptation
(pure), then against a real Redis: the gatekeeper writes each prompt's history with separate easy
and hard streaks, the feeder reads it and skips a prompt with its kind's probability, never more
often than the exploration floor allows, adapts the probabilities at each policy version, and the
history and the adapted state outlive the learner that read them."""

from __future__ import annotations

import math

import pytest

from contracts.bus import MAX_PROMPTS, StreamBus, connect
from contracts.config import PromptSkipConfig
from contracts.data import PromptRecord
from contracts.keys import LEDGER_FILTERED, Counter, Keys, RunField
from contracts.schemas import PromptJob, Response, ScoredGroup, decode_job, encode_group
from learner.feeder import PromptFeeder
from learner.prompt_skip import Decided, SkipState, adapt_keep_base, keep_probability
from tests.helpers import gatekeeper_on

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
        records(),
        Chars(),
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
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


def gate(bus: StreamBus, prompt_index: int, acc: list[bool], *, data_epoch: int = 0) -> None:
    """One scored group of `prompt_index` through the real gatekeeper."""
    job = PromptJob(
        group_id=f"g-{prompt_index}-{data_epoch}-{sum(acc)}",
        prompt_index=prompt_index,
        data_epoch=data_epoch,
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
    gatekeeper = gatekeeper_on(bus.as_consumer("gatekeeper"))
    gatekeeper.handle(gatekeeper.transport.read(bus.keys.scored, count=10, block_ms=10))


# --- the rule (pure) ------------------------------------------------------------------------


def keep(easy: int, hard: int, skip: PromptSkipConfig) -> float:
    """The keep probability of a prompt with these streaks, at the config's starting bases."""
    return keep_probability(
        easy,
        hard,
        keep_easy=skip.easy_keep_base,
        keep_hard=skip.hard_keep_base,
        min_keep=skip.min_keep,
    )


def test_each_streak_uses_its_own_base_and_stops_at_the_floor() -> None:
    skip = PromptSkipConfig(easy_keep_base=0.5, hard_keep_base=0.8, min_keep=0.1)
    assert [keep(z, 0, skip) for z in range(5)] == [1.0, 0.5, 0.25, 0.125, 0.1]
    assert [keep(0, z, skip) for z in range(3)] == [1.0, 0.8, pytest.approx(0.64)]
    assert keep(200, 0, skip) == keep(0, 200, skip) == 0.1


def test_at_equal_streaks_all_wrong_prompts_are_explored_more_than_all_right_ones() -> None:
    skip = PromptSkipConfig()  # the defaults
    for z in range(1, 16):
        assert keep(0, z, skip) >= keep(z, 0, skip)
        if keep(z, 0, skip) > skip.min_keep:  # above the floor, strictly more
            assert keep(0, z, skip) > keep(z, 0, skip)
    assert skip.hard_target > skip.easy_target  # and adaptation holds the hard base higher


def test_adaptation_steps_toward_the_target_and_stays_in_bounds() -> None:
    bounds = {"step": 0.01, "low": 0.05, "high": 0.95}
    # More groups of the kind than the target: skip more (lower p); fewer: explore more.
    assert adapt_keep_base(0.5, 0.3, 0.2, **bounds) == pytest.approx(0.49)
    assert adapt_keep_base(0.5, 0.2, 0.2, **bounds) == pytest.approx(0.49)
    assert adapt_keep_base(0.5, 0.1, 0.2, **bounds) == pytest.approx(0.51)
    assert adapt_keep_base(0.055, 0.9, 0.2, **bounds) == 0.05
    assert adapt_keep_base(0.945, 0.0, 0.2, **bounds) == 0.95
    assert adapt_keep_base(0.99, 0.0, 0.2, **bounds) == 0.95  # a base from wider old bounds
    p = 0.5
    for _ in range(200):
        p = adapt_keep_base(p, 1.0, 0.2, **bounds)
        assert 0.05 <= p <= 0.95
    assert p == 0.05


def test_adaptation_settles_where_the_share_meets_the_target() -> None:
    """A closed loop: the share of a kind generated grows with its keep probability (here
    0.3 x p). From either side, p ends within a step of the p that gives the target share."""
    bounds = {"step": 0.01, "low": 0.05, "high": 0.95}
    for start in (0.05, 0.95):
        p, seen = start, []
        for _ in range(300):
            p = adapt_keep_base(p, 0.3 * p, 0.1, **bounds)
            seen.append(p)
        assert all(abs(q - 1 / 3) <= 0.011 for q in seen[-50:]), (start, seen[-5:])


def test_a_step_adapts_easy_and_hard_separately_from_the_window_of_decisions() -> None:
    state = SkipState(0.5, 0.5, policy_version=3, opened=Decided(100, 10, 10))
    targets = {"easy_target": 0.1, "hard_target": 0.2, "step": 0.01, "low": 0.05, "high": 0.95}
    # 100 groups decided since version 3: 30 easy (over 10%), 5 hard (under 20%).
    now = Decided(200, 40, 15)
    after = state.step(4, now, adapt=True, **targets)
    assert after.keep_easy == pytest.approx(0.49) and after.keep_hard == pytest.approx(0.51)
    assert (after.policy_version, after.opened) == (4, now)  # the next window opens here
    # The first data epoch (adapt=False), an empty window, or counts that went back (Redis lost
    # its data): the bases stay, and the next window opens at the new counts.
    for version, counts, adapt in (
        (4, now, False),
        (4, state.opened, True),
        (4, Decided(5, 1, 1), True),
    ):
        held = state.step(version, counts, adapt=adapt, **targets)
        assert (held.keep_easy, held.keep_hard, held.opened) == (0.5, 0.5, counts)


def test_the_state_round_trips_through_json_and_refuses_anything_else() -> None:
    state = SkipState(0.37, 0.81, policy_version=12, opened=Decided(900, 80, 150))
    assert SkipState.from_json(state.to_json()) == state
    for bad in ("{}", "[1]", "not json", state.to_json().replace("0.81", "1.5")):
        with pytest.raises((ValueError, TypeError, KeyError)):
            SkipState.from_json(bad)


# --- the history and the feeder, against Redis -----------------------------------------------


def test_the_gatekeeper_records_each_prompts_groups(bus: StreamBus) -> None:
    gate(bus, 3, [True, True, True, True])  # all right: no signal, filtered, easy
    three = bus.prompt_stats([3])[0]
    assert (three.easy_streak, three.hard_streak) == (1, 0)
    gate(
        bus, 3, [False] * 4, data_epoch=1
    )  # all wrong: no signal, hard, which ends the easy streak
    gate(bus, 7, [True, False, False, False], data_epoch=1)  # kept
    never, three, seven = bus.prompt_stats([0, 3, 7])
    assert never.seen == 0 and never.pass_rate is None
    assert (three.seen, three.data_epoch, three.easy_streak, three.hard_streak) == (2, 1, 0, 1)
    assert three.kept == 0 and three.pass_rate == 0.0
    assert (seven.seen, seven.streak, seven.kept, seven.pass_rate) == (1, 0, 1, 0.25)
    gate(bus, 3, [True, False, True, True], data_epoch=2)  # signal again: both streaks restart
    assert bus.prompt_stats([3])[0].streak == 0
    assert bus.ledger().filtered == 2 and bus.counters()[Counter.GATEKEEPER_KEPT] == 2
    counters = bus.counters()
    assert counters[Counter.ZERO_ADVANTAGE_EASY] == counters[Counter.ZERO_ADVANTAGE_HARD] == 1


def test_streaks_of_each_kind_grow_reset_each_other_and_saturate(bus: StreamBus) -> None:
    def record(correct: int, kept: bool = False) -> tuple[int, int]:
        bus.record_prompt_outcome(5, data_epoch=0, correct=correct, size=4, kept=kept)
        stats = bus.prompt_stats([5])[0]
        return stats.easy_streak, stats.hard_streak

    assert [record(4) for _ in range(3)] == [(1, 0), (2, 0), (3, 0)]
    assert [record(0) for _ in range(2)] == [(0, 1), (0, 2)]
    assert record(4) == (1, 0)
    assert record(2, kept=True) == (0, 0)
    assert [record(0) for _ in range(20)][-1] == (0, 15)  # 4 bits: saturates, never wraps
    stats = bus.prompt_stats([5])[0]
    assert (stats.seen, stats.kept, stats.correct, stats.size) == (27, 1, 0, 4)


def test_a_prompt_out_of_range_is_not_recorded(bus: StreamBus) -> None:
    assert not bus.record_prompt_outcome(MAX_PROMPTS, data_epoch=0, correct=0, size=4, kept=False)
    assert bus.prompt_history_bytes() == 0 and bus.prompt_stats([MAX_PROMPTS])[0].seen == 0


def test_prompts_without_a_streak_are_never_skipped(bus: StreamBus) -> None:
    for i in range(0, N_PROMPTS, 2):  # half the prompts had signal last time
        bus.record_prompt_outcome(i, data_epoch=0, correct=1, size=4, kept=True)
    f = feeder(bus, PromptSkipConfig(enabled=True), limit=N_PROMPTS)
    assert f.admit(0) == N_PROMPTS  # one epoch, with no zero-advantage streak anywhere
    assert issued_rows(bus) == list(range(N_PROMPTS)) and f.skipped == 0
    assert f.cursor == N_PROMPTS == f.jobs_issued


def test_a_long_streak_is_skipped_with_the_floors_probability(bus: StreamBus) -> None:
    skip = PromptSkipConfig(enabled=True, hard_keep_base=0.5, min_keep=0.2)
    for i in range(N_PROMPTS):  # 10 zero-advantage groups in a row: 0.5**10 is below the floor
        for _ in range(10):
            bus.record_prompt_outcome(i, data_epoch=0, correct=0, size=8, kept=False)
    f = feeder(bus, skip)
    assert f.admit(0) == 10_000
    seen = f.cursor  # every position the feeder came to: issued or skipped
    assert bus.run_int(RunField.DATA_CURSOR) == seen  # recorded for a restarted learner
    issued = bus.ledger().issued
    assert issued == 10_000 == f.jobs_issued and f.skipped == seen - issued
    assert bus.counters()[Counter.PROMPTS_SKIPPED] == f.skipped
    # Issued with probability exactly min_keep (binomial, within 5 standard deviations), so
    # skipped with 1 - min_keep: more than hard_keep_base ** 10 would give, never every time.
    p = issued / seen
    assert abs(p - 0.2) < 5 * math.sqrt(0.2 * 0.8 / seen), p


def test_a_streak_of_one_keeps_about_half(bus: StreamBus) -> None:
    for i in range(N_PROMPTS):
        bus.record_prompt_outcome(i, data_epoch=0, correct=8, size=8, kept=False)
    f = feeder(bus, PromptSkipConfig(enabled=True, easy_keep_base=0.5, min_keep=0.05))
    f.admit(0)
    p = f.jobs_issued / f.cursor
    assert abs(p - 0.5) < 5 * math.sqrt(0.25 / f.cursor), p


def test_skipping_off_issues_every_prompt_whatever_its_history(bus: StreamBus) -> None:
    for i in range(N_PROMPTS):
        for _ in range(10):
            bus.record_prompt_outcome(i, data_epoch=0, correct=0, size=8, kept=False)
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
            bus.record_prompt_outcome(i, data_epoch=0, correct=0, size=8, kept=False)
    f = feeder(bus, PromptSkipConfig(enabled=True, hard_keep_base=0.5, min_keep=0.1))
    f.max_jobs = 30
    assert f.admit(0) == 30 and f.admit(0) == 0
    assert bus.ledger().issued == 30 < f.cursor
    jobs = [decode_job(fields) for _, fields in bus.redis.xrange(bus.keys.prompts.stream)]
    assert [j.data_epoch for j in jobs] == [cursor // N_PROMPTS for cursor in cursors(jobs)]
    assert max(j.data_epoch for j in jobs) >= 1  # 30 of 50 at 1/8 each: several passes


def cursors(jobs: list[PromptJob]) -> list[int]:
    return [int(j.group_id.rsplit("-", 1)[1]) for j in jobs]


def test_a_planted_value_where_the_history_belongs_is_skipped_and_replaced(
    bus: StreamBus,
) -> None:
    bus.redis.hset(bus.keys.prompt_history, "x", "1")
    assert all(s.seen == 0 for s in bus.prompt_stats([0, 1]))
    assert bus.counters()[Counter.BAD_REDIS_VALUES] >= 1
    assert bus.record_prompt_outcome(1, data_epoch=0, correct=0, size=4, kept=False)
    assert bus.prompt_stats([1])[0].streak == 1


def test_at_equal_streaks_the_feeder_issues_all_wrong_prompts_more_often(bus: StreamBus) -> None:
    for i in range(N_PROMPTS):  # two zero-advantage groups in a row: even all right, odd wrong
        for _ in range(2):
            bus.record_prompt_outcome(i, data_epoch=0, correct=8 * (i % 2 == 0), size=8, kept=False)
    skip = PromptSkipConfig(enabled=True)  # the default bases: 0.5 easy, 0.75 hard
    f = feeder(bus, skip, limit=4000)
    assert f.admit(0) == 4000
    rows, per_kind = issued_rows(bus), f.cursor / 2  # the cursor alternates easy, hard
    easy = sum(r % 2 == 0 for r in rows) / per_kind
    hard = sum(r % 2 == 1 for r in rows) / per_kind
    for rate, expected in ((easy, 0.5**2), (hard, 0.75**2)):
        assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / per_kind)
    assert hard > 2 * easy


def decide(bus: StreamBus, *, kept: int, easy: int, hard: int) -> None:
    """The gatekeeper's counts after deciding `kept` groups with signal and `easy` + `hard`
    without (filtered)."""
    bus.incr(Counter.GATEKEEPER_KEPT, kept)
    bus.redis.hincrby(bus.keys.ledger, LEDGER_FILTERED, easy + hard)
    bus.incr(Counter.ZERO_ADVANTAGE_EASY, easy)
    bus.incr(Counter.ZERO_ADVANTAGE_HARD, hard)


def bases(f: PromptFeeder) -> tuple[float, float]:
    assert f.skip_state is not None
    return round(f.skip_state.keep_easy, 6), round(f.skip_state.keep_hard, 6)


def test_the_feeder_adapts_each_base_per_policy_version_and_a_restart_goes_on(
    bus: StreamBus, redis_url: str
) -> None:
    skip = PromptSkipConfig(enabled=True, easy_keep_base=0.5, hard_keep_base=0.5, adapt_step=0.1)
    f = feeder(bus, skip, limit=0)  # issues nothing: only the adaptation is watched
    f.admit(0)
    decide(bus, kept=60, easy=30, hard=10)
    f.admit(1)  # still in the first data epoch: nothing adapts (GRESO), the window moves on
    assert bases(f) == (0.5, 0.5)
    f.cursor = N_PROMPTS  # the second data epoch
    decide(bus, kept=60, easy=30, hard=10)  # 30% easy (target 8.3%), 10% hard (target 16.7%)
    f.admit(1)
    assert bases(f) == (0.5, 0.5)  # the same version: the step is not over
    f.admit(2)
    assert bases(f) == (0.4, 0.6)  # skip more of the easy ones, explore the hard ones more

    restarted = feeder(StreamBus(connect(redis_url), Keys("skip"), consumer="learner-2"), skip)
    restarted.limit = restarted.kept_ahead = 0
    restarted.cursor = f.cursor
    restarted.admit(2)
    assert restarted.skip_state == f.skip_state  # read from the run info, not started afresh
    decide(bus, kept=100, easy=0, hard=0)  # both kinds under their targets: explore more
    restarted.admit(3)
    assert bases(restarted) == (0.5, 0.7)
    assert SkipState.from_json(bus.run_field(RunField.PROMPT_SKIP) or "") == restarted.skip_state


def test_a_malformed_stored_state_is_counted_and_started_afresh(bus: StreamBus) -> None:
    bus.update_run_info({RunField.PROMPT_SKIP: "{not json"})
    f = feeder(bus, PromptSkipConfig(enabled=True), limit=0)
    f.admit(0)
    assert bases(f) == (0.5, 0.75)
    assert bus.counters()[Counter.BAD_REDIS_VALUES] == 1
