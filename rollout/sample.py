"""What an engine returns per sampled response (in a module of its own so that the engines and
their interface, `rollout.engine`, import it without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One sampled response: tokens (EOS included when produced) and their behaviour log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    versions: tuple[int, int] | None = None
    """(lowest, highest) policy version that sampled a token of this response, over every
    version the engine's `between_steps` hook returned while it was generated (not the first and
    the last: a failed broadcast and a reload of an older checkpoint lower the version).
    None when generated without the hook (then no weights can have changed mid-generation)."""
