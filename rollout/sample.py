"""What an engine returns per sampled response (in a module of its own so that the engines and
their interface, `rollout.engine`, import it without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One sampled response: tokens (EOS included when produced) and their behaviour log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop" (an end token, kept), "length" (`max_tokens`), or "stop_string" (one of the
    `stop` strings `generate` was given; the tokens that complete it are kept)."""
    versions: tuple[int, int] | None = None
    """(lowest, highest) policy version that sampled a token of this response, over every
    version the engine's `between_steps` hook returned while it was generated (not the first and
    the last: a failed broadcast and a reload of an older checkpoint lower the version).
    None when generated without the hook (then no weights can have changed mid-generation)."""
    tool_spans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each tool result inserted among `token_ids` (multi-turn generation,
    `rollout.tool_use`): tokens the model did not sample, log-prob 0. Empty: all sampled."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that returned an error text to the model (time-outs included)."""
    tool_timeouts: int = 0
    tool_seconds: float = 0.0

    @property
    def response_finish(self) -> str:
        """The finish reason a finished response records: a `rollout.stop` string ends it as an
        end token does ("stop"); tool calls never reach here as "stop_string" (`tool_use`
        continues them)."""
        return "stop" if self.finish_reason == "stop_string" else self.finish_reason
