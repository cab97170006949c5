"""Admission control's pass rate is the recent one (`algorithm.pass_rate_window`): a run of
filtered groups after many kept ones lowers it within the window, where the run's own rate
barely moves, so the feeder issues the replacements; a restarted learner goes on from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from contracts.bus import StreamBus, connect, pass_rate
from contracts.data import PromptRecord
from contracts.keys import LEDGER_FILTERED, Counter, Keys, RunField
from learner.feeder import PromptFeeder, RecentPassRate

WINDOW = 100
RECORD = PromptRecord(
    index=0,
    messages=[{"role": "user", "content": "1+1"}],
    ground_truth="2",
    data_source="t",
    extra_info={},
)


def test_a_run_of_filtered_groups_lowers_the_recent_rate_within_the_window() -> None:
    recent = RecentPassRate().update(10_000, 0, WINDOW)
    assert recent.rate == 1.0  # nothing stored to go on from: the run's rate
    kept, filtered = 10_000, 0
    for _ in range(20):  # 200 filtered groups, 10 between two admissions
        filtered += 10
        recent = recent.update(kept, filtered, WINDOW)
    assert pass_rate(kept, filtered) == pytest.approx(0.98, abs=0.001)  # the run's barely moved
    # Two windows of filtered groups: (1 - 1/100) ** 200 of the old rate is left.
    assert recent.rate == pytest.approx(0.99**200, rel=1e-9)
    assert recent.rate is not None and recent.rate < 0.15
    # Kept again: it climbs back as fast.
    recent = recent.update(kept + 200, filtered, WINDOW)
    assert recent.rate is not None and recent.rate > 0.85


def test_the_recent_rate_is_the_runs_while_the_run_fits_in_the_window() -> None:
    recent = RecentPassRate().update(0, 0, WINDOW)
    assert recent.rate is None  # nothing decided yet
    recent = recent.update(3, 1, WINDOW).update(30, 40, WINDOW)
    assert recent.rate == pytest.approx(30 / 70)
    assert RecentPassRate().update(10_000, 200, None).rate == pass_rate(10_000, 200)  # no window


def test_counts_that_went_back_start_from_the_runs_rate_again() -> None:
    """Redis lost its data: the counts start over, and a difference would mean nothing."""
    recent = RecentPassRate(0.1, kept=5_000, filtered=5_000)
    assert recent.update(150, 50, WINDOW) == RecentPassRate(0.75, 150, 50)
    assert recent.update(5_000, 5_000, WINDOW) is recent  # nothing new: unchanged


def test_the_recent_rate_round_trips_through_json_and_refuses_anything_else() -> None:
    recent = RecentPassRate(0.42, kept=420, filtered=580)
    assert RecentPassRate.from_json(recent.to_json()) == recent
    assert RecentPassRate.from_json(RecentPassRate().to_json()) == RecentPassRate()
    for bad in ("{}", "[]", "nope", '{"rate": 7, "kept": 1, "filtered": 1}'):
        with pytest.raises((ValueError, TypeError, KeyError)):
            RecentPassRate.from_json(bad)


# --- through the feeder, against Redis --------------------------------------------------------


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("feeder"), consumer="learner")
    b.ensure_groups()
    return b


def feeder(bus: StreamBus) -> PromptFeeder:
    return PromptFeeder(
        [RECORD],
        SimpleNamespace(encode=lambda text, add_special_tokens: [5, 6]),
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
        run_name="t",
        limit=1_000,
        kept_ahead=10,
        max_prompt_len=16,
        shuffle=False,
        seed=0,
        pass_rate_window=WINDOW,
    )


def test_the_feeder_replaces_a_run_of_filtered_groups_late_in_a_run(
    bus: StreamBus, redis_url: str
) -> None:
    bus.incr(Counter.GATEKEEPER_KEPT, 10_000)  # a long run the gatekeeper kept nearly all of
    f = feeder(bus)
    assert f.admit(0) == 10  # at a pass rate of 1: ten jobs for ten groups ahead
    for _ in range(20):  # then 200 filtered, seen 10 at a time
        bus.redis.hincrby(bus.keys.ledger, LEDGER_FILTERED, 10)
        f.admit(0)
    assert f.recent is not None and f.recent.rate is not None and f.recent.rate < 0.15
    run_rate = bus.pass_rate()
    assert run_rate is not None and run_rate > 0.97
    # The jobs in flight are expected to yield about one group each in seven, not nearly one
    # each: the feeder issued the shortfall. With the run's rate the first ten would have
    # looked enough, and it would have issued one more job in all.
    in_flight = bus.ledger().train_in_flight
    assert in_flight > 6 * 11
    assert f.wanted(in_flight=10, train_depth=0, pass_rate=run_rate) == 1

    # A restarted learner takes the average from the run info instead of the run's 0.98, and
    # admits what the old one would have.
    expected = f.wanted(in_flight=in_flight, train_depth=0, pass_rate=f.recent.rate)
    restarted = feeder(StreamBus(connect(redis_url), Keys("feeder"), consumer="learner-2"))
    assert restarted.admit(0) == expected
    assert restarted.recent == f.recent
    stored = bus.run_field(RunField.RECENT_PASS_RATE)
    assert stored is not None and RecentPassRate.from_json(stored) == f.recent
