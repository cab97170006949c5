"""Overlong reward shaping and filtering (docs/algorithm.md s2)."""

from __future__ import annotations

from functools import partial

import pytest

from reward import overlong_penalty, shaped_reward

# Paper defaults: L_max 20480, L_cache 4096, factor 1.0 -> expected 16384.
MAX_LEN, BUFFER_LEN, FACTOR = 20480, 4096, 1.0


@pytest.mark.parametrize(
    ("length", "penalty"),
    [
        (0, 0.0),
        (100, 0.0),
        (16384, 0.0),  # exactly the expected length
        (16385, -1 / 4096),
        (16384 + 2048, -0.5),  # midpoint of the buffer
        (20480, -1.0),  # the maximum length: -factor
    ],
)
def test_penalty_at_boundary_points(length: int, penalty: float) -> None:
    assert overlong_penalty(length, MAX_LEN, BUFFER_LEN, FACTOR) == pytest.approx(penalty)


def test_penalty_scales_with_factor() -> None:
    assert overlong_penalty(20480, MAX_LEN, BUFFER_LEN, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(20480, MAX_LEN, BUFFER_LEN, 0.0) == 0.0


def test_penalty_is_never_positive() -> None:
    assert all(overlong_penalty(n, 100, 10, 2.0) <= 0.0 for n in range(0, 200))


@pytest.mark.parametrize(
    ("max_len", "buffer_len", "names"),
    [
        (100, 0, "buffer_len=0"),
        (100, -5, "buffer_len=-5"),
        (100, 100, "buffer_len=100, max_len=100"),
        (100, 200, "buffer_len=200, max_len=100"),
    ],
)
def test_invalid_lengths_are_rejected(max_len: int, buffer_len: int, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        overlong_penalty(50, max_len, buffer_len, 1.0)


def test_negative_factor_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"factor=-1\.0"):
        overlong_penalty(50, 100, 10, -1.0)


def test_shaped_reward_range_and_switch() -> None:
    shaped = partial(shaped_reward, max_len=MAX_LEN, buffer_len=BUFFER_LEN, factor=FACTOR)
    assert shaped(1.0, 100) == 1.0
    assert shaped(1.0, 18432) == pytest.approx(0.5)
    assert shaped(-1.0, 20480) == pytest.approx(-2.0)
    assert shaped(-1.0, 20480, enabled=False) == -1.0
