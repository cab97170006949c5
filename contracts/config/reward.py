"""`reward`: which verifier or function scores each response, and the overlong shaping."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from contracts.config.base import PositiveInt, Section

Verifier = Literal[
    "dapo-reference",
    "dapo-strict",
    "dapo",
    "strict-box",
    "math-verify",
    "first-line",
    "first-number",
    "reasoning-gym",
]


class OverlongConfig(Section):
    """Overlong reward shaping, docs/algorithm.md section 2."""

    enabled: bool = True
    buffer_len: PositiveInt = 4096
    """L_cache: the soft-punishment interval before L_max (paper: 4096)."""
    penalty_factor: float = Field(1.0, ge=0)
    """Penalty at L_max (paper: 1.0, so reward ranges over [-2, +1])."""
    filter: bool = False
    """Overlong filtering: zero loss mask for truncated responses (off in the reference run)."""


class RewardConfig(Section):
    verifier: Verifier = "dapo-reference"
    """`dapo-reference` (the reference code's Answer: line rule, quirks included: the one whose
    numbers compare with the paper's), `dapo-strict` (the same rule with three deliberate
    departures, listed in `reward.rules.verify_dapo_strict`; `dapo` is its alias, kept so
    older configs score as before), `strict-box`, `math-verify`, or for a completer's one-line
    answer (`data.prompt_format: completion`) `first-line` (the first line is exactly the
    answer) or `first-number` (its first integer is), or `reasoning-gym` (each row's own
    reasoning-gym task scorer, in the sandbox workers: `reward.gym_checker`).

    Which scorer a row gets: `function` when set (every row); else its `data_source`'s entry in
    `verifier_by_source`; else, for a row generated from reasoning-gym (`data.gym`: its
    `extra_info` carries the task's entry), `reasoning-gym`; else this."""
    verifier_by_source: dict[str, Verifier] = Field(default_factory=dict)
    """A verifier per `data_source`, for files that mix sources (verl's parquet selects its scorer
    by each row's `data_source`): e.g. `{openai/gsm8k: first-number, math_dapo: dapo-reference}`.
    Sources not listed get `verifier` (or, for reasoning-gym rows, their task's scorer)."""
    function: str | None = None
    """Your own reward instead of the verifier: `package.module:function` or
    `path/to/file.py:function`, called as f(response, ground_truth, extra_info) and returning
    `reward.RewardOutput(score, acc, pred, metrics)` or a dict of those keys (`reward.custom`
    documents it). Runs in the sandbox workers under `timeout_s`; one that cannot be loaded
    stops `dapo run` and `dapo reward` at start. None = the verifier."""
    timeout_s: float = Field(5.0, gt=0)
    """Hard per-response limit for the sandbox workers (math-verify, reasoning-gym's scorers or
    `function`); a timeout scores -1 and is counted."""
    sandbox_workers: PositiveInt = 2
    """Killable worker processes of each sandboxed scorer (math-verify, reasoning-gym, or
    `function`)."""
    grade_tool_results: bool = False
    """With `rollout.tools`: grade the full response text, tool results included. Off (default):
    the verifier or `function` sees only what the model wrote, its turns joined without the
    `<result>...</result>` spans, so an answer a tool printed is not taken as the model's."""
    overlong: OverlongConfig = OverlongConfig()

    @field_validator("function")
    @classmethod
    def _check_function(cls, value: str | None) -> str | None:
        # Form only: loading runs the user's code, which the reward service does in a sandbox.
        if value is not None:
            location, colon, name = value.rpartition(":")
            if not colon or not location.strip() or not name.strip():
                raise ValueError("expected 'package.module:function' or 'path/to/file.py:function'")
        return value
