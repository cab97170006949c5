"""Sampling seeds that make evaluation paired: a sample's seed is a function of what it is
(problem, sample index, turn, `eval.seed`), never of the process or replica that draws it."""

from __future__ import annotations

import hashlib


def eval_seeds(seed: int, problem: int, samples: int) -> list[int]:
    """The sampling seeds of one evaluation problem's `samples` samples: a function of
    (`eval.seed`, the problem's index in the evaluation set, the sample index) alone, so every
    run, replica count, restart and `dapo eval` draws the same samples from the same weights
    (paired evaluation: two runs' rounds differ only by their weights)."""
    return [_seed31(f"eval:{seed}:{problem}:{j}") for j in range(samples)]


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a sample's turn after `turn` tool calls (turn 0: the sample's own seed)."""
    return seed if turn == 0 else _seed31(f"turn:{seed}:{turn}")


def _seed31(text: str) -> int:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF  # vLLM seeds numpy: < 2**32
