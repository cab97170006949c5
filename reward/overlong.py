"""Overlong reward shaping and overlong filtering (docs/algorithm.md s2).

Soft overlong punishment: a response longer than ``expected = max_len - buffer_len`` tokens
loses reward linearly, reaching ``-factor`` at ``max_len``:

    penalty = min(-(length - expected) / buffer_len * factor, 0)

With the paper's defaults (``max_len`` 20480, ``buffer_len`` 4096, ``factor`` 1.0) and a +-1
score, the shaped reward lies in [-2, +1]. Lengths past ``max_len`` are not clipped, as in the
reference; a sampler capped at ``max_len`` never produces them.

Overlong filtering (off by default in the reference run) instead gives truncated responses
(finish reason ``"length"``) a zero loss mask; the learner applies it when it builds a batch
(`learner/batch.py`, `reward.overlong.filter`).
"""

from __future__ import annotations


def _check_lengths(max_len: int, buffer_len: int) -> None:
    if buffer_len <= 0:
        raise ValueError(f"buffer_len must be > 0, got buffer_len={buffer_len}")
    if buffer_len >= max_len:
        raise ValueError(
            f"buffer_len must be < max_len, got buffer_len={buffer_len}, max_len={max_len}; "
            "lower overlong.buffer_len or raise the maximum response length"
        )


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """Soft overlong penalty of a response of ``length`` tokens (docs/algorithm.md s2), always <= 0.

    Args:
        length: response length in tokens.
        max_len: maximum response length ``L_max`` (paper: 20480).
        buffer_len: punishment buffer ``L_cache`` (paper: 4096), 0 < buffer_len < max_len.
        factor: penalty at ``length == max_len`` is ``-factor`` (paper: 1.0), >= 0.

    Raises:
        ValueError: on an invalid ``buffer_len`` / ``max_len`` pair or a negative ``factor``.
    """
    _check_lengths(max_len, buffer_len)
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got factor={factor}")
    expected = max_len - buffer_len
    return min(-(length - expected) / buffer_len * factor, 0.0)


def shaped_reward(
    score: float,
    length: int,
    *,
    max_len: int,
    buffer_len: int,
    factor: float,
    enabled: bool = True,
) -> float:
    """``score + overlong_penalty(...)`` (docs/algorithm.md s2);
    just ``score`` when not ``enabled``."""
    if not enabled:
        return score
    return score + overlong_penalty(length, max_len, buffer_len, factor)
