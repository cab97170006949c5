"""Multi-turn generation with tools (`rollout.tools`, docs/algorithm.md section 12).

The model calls a tool by writing `<NAME>ARGS</NAME>` (NAME: `calculator`, `python`, or a user
function's name), a plain tag format that a model without a tool-call chat format can learn
from a few traces. Generation stops at the closing tag (the engines' `stop` strings); the call
runs in a sandbox (`sandbox.pool`: its own process, no network, no secrets, a time and memory
limit); its result, cut to `max_result_tokens`, goes back into the response as
`<result>TEXT</result>`; generation goes on from there, up to `max_turns` calls. A failing,
hanging or crashing call returns an error text to the model (`error: ...`): the response and its
group are never lost to a tool.

What a response records (a `Sample`): every token in order, the model's and the inserted
results'; `tool_spans` mark the [start, end) of each inserted result. Inserted tokens carry
log-prob 0 and are context only: the learner gives them loss mask 0, computes the
log-probs of the model's tokens over the whole trajectory, and the overlong penalty counts the
model's tokens (`max_response_len` bounds them, not the results). Each model token keeps the
log-prob and the policy version it was sampled with: weights may change between two turns, or
inside one (in-flight updates), and `versions` spans all of them.

With vLLM (`VLLMEngine.generate_turns`) every response is a request of its own: when one stops at
a call, the call runs on a thread (up to `rollout.tools.workers` per tool at once) while the
engine goes on generating the others, and its next turn is enqueued as soon as the call returns.
The transformers engine generates a batch in one `generate` call, so there generation runs in
rounds: every response generates until it ends or calls a tool, the round's calls run
concurrently, then every response that called continues, batched. A response past
`max_turns` calls ends at its next call, unanswered (finish reason "stop"); one whose model
tokens reach `max_response_len` ends with "length".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from contracts.config import RESULT_TAG_TOKENS, ConfigError, ToolsConfig, tool_name
from rollout.engine import BetweenSteps, Engine, turn_seed
from rollout.sample import Sample
from sandbox.builtin_tools import BUILTIN_TOOLS
from sandbox.pool import CallResult, Sandbox, SandboxStartError

log = logging.getLogger(__name__)

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: str | None
    """None: the closing tag came without its opening tag (a malformed call)."""


class ToolBox:
    """The configured tools, each in its own sandbox, and the tag format around them."""

    def __init__(self, cfg: ToolsConfig, tokenizer: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self._open = self._encode(RESULT_OPEN)
        self._close = self._encode(RESULT_CLOSE)
        if len(self._open) + len(self._close) > RESULT_TAG_TOKENS:
            raise ValueError(
                f"the tokenizer spells {RESULT_OPEN}{RESULT_CLOSE} in over {RESULT_TAG_TOKENS} "
                "tokens"
            )
        self.sandboxes: dict[str, Sandbox] = {}
        try:
            for spec in cfg.functions:
                self.sandboxes[tool_name(spec)] = Sandbox(
                    BUILTIN_TOOLS.get(spec, spec),
                    workers=cfg.workers,
                    timeout_s=cfg.timeout_s,
                    memory_bytes=cfg.memory_mb << 20,
                    max_result_chars=64 * cfg.max_result_tokens,
                )
        except BaseException:
            self.close()
            raise
        self.stops = tuple(f"</{name}>" for name in self.sandboxes)
        self.threads = cfg.workers * len(self.sandboxes)
        """Calls that may run at once: every tool's every worker."""
        self.isolation = next(iter(self.sandboxes.values())).network_isolation

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def find_call(self, text: str) -> ToolCall:
        """The call that ends `text` (a model span that stopped at a closing tag)."""
        at, name = max((text.rfind(f"</{n}>"), n) for n in self.sandboxes)
        start = text.rfind(f"<{name}>", 0, at)
        if at < 0 or start < 0:
            return ToolCall(name, None)
        return ToolCall(name, text[start + len(name) + 2 : at].strip())

    def run(self, calls: Sequence[ToolCall]) -> list[CallResult]:
        """Every call, those of one tool concurrently on its workers; results in order."""
        results: list[CallResult | None] = [None] * len(calls)
        for name, sandbox in self.sandboxes.items():
            mine = [i for i, c in enumerate(calls) if c.name == name and c.args is not None]
            done = sandbox.call_many([calls[i].args or "" for i in mine])
            for i, result in zip(mine, done, strict=True):
                results[i] = result
        for i, call in enumerate(calls):
            if results[i] is None:
                results[i] = CallResult(False, f"error: </{call.name}> without <{call.name}>")
        return [r for r in results if r is not None]

    def result_tokens(self, result: CallResult) -> list[int]:
        """`<result>TEXT</result>` with TEXT cut to `max_result_tokens` tokens; the tags' tokens
        (`RESULT_TAG_TOKENS` at most) come on top."""
        return self._open + self._encode(result.text)[: self.cfg.max_result_tokens] + self._close

    def close(self) -> None:
        for sandbox in self.sandboxes.values():
            sandbox.close()

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_tools(cfg: ToolsConfig) -> None:
    """Load every tool once in a throw-away sandbox worker (nothing when tools are off), so a
    function that cannot be loaded stops `dapo run` before any replica starts.

    Raises:
        ConfigError: the message names `rollout.tools.functions`, the tool and why.
    """
    if not cfg.enabled:
        return
    for spec in cfg.functions:
        try:
            Sandbox(BUILTIN_TOOLS.get(spec, spec), workers=1, timeout_s=cfg.timeout_s).close()
        except SandboxStartError as exc:
            raise ConfigError(f"rollout.tools.functions: {spec!r} cannot be used: {exc}") from None


@dataclass
class _Trajectory:
    """One response being built over several turns."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each result
    span_start: int = 0  # where the model's current span began (after the last result)
    finish_reason: str = "length"
    versions: tuple[int, int] | None = None
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    tool_seconds: float = 0.0

    @property
    def model_tokens(self) -> int:
        return len(self.tokens) - sum(end - start for start, end in self.spans)

    def take(self, sample: Sample, budget: int) -> None:
        """Append a turn the model sampled, at most `budget` tokens of it."""
        keep = sample.token_ids[:budget]
        self.tokens += keep
        self.logprobs += sample.logprobs[: len(keep)]
        cut = len(keep) < len(sample.token_ids)
        self.finish_reason = "length" if cut else sample.finish_reason
        if sample.versions is not None:
            low, high = sample.versions
            if self.versions is not None:
                low, high = min(low, self.versions[0]), max(high, self.versions[1])
            self.versions = (low, high)

    def insert(self, tokens: list[int], result: CallResult) -> None:
        """Append a tool's result: context for the model, not its own tokens."""
        self.spans.append((len(self.tokens), len(self.tokens) + len(tokens)))
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.span_start = len(self.tokens)
        self.calls += 1
        self.errors += not result.ok
        self.timeouts += result.timed_out
        self.tool_seconds += result.seconds

    def sample(self) -> Sample:
        return Sample(
            self.tokens,
            self.logprobs,
            self.finish_reason,
            self.versions,
            tool_spans=self.spans,
            tool_calls=self.calls,
            tool_errors=self.errors,
            tool_timeouts=self.timeouts,
            tool_seconds=round(self.tool_seconds, 6),
        )


def generate_with_tools(
    engine: Engine,
    tools: ToolBox,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seeds: Sequence[Sequence[int]] | None = None,
    between_steps: BetweenSteps | None = None,
    on_round: Callable[[], None] | None = None,
    stop: Sequence[str] = (),
) -> list[list[Sample]]:
    """For each prompt, n responses that may call the tools (module docstring). `max_tokens`
    bounds each response's model tokens. An engine that can continue one response while others
    generate (`generate_turns`: vLLM) runs each call as soon as its response stops at it, and
    that response's next turn as soon as the call returns; otherwise generation runs in rounds
    (`on_round` runs before each continuation round: the tests' hook). With `seeds`
    (`Engine.generate`), the turn after t calls of sample j of prompt i is drawn with
    `turn_seed(seeds[i][j], t)`. `stop` must be empty: a stop string would end a response in
    the middle of its call (the config refuses `rollout.stop` with tools)."""
    if stop:
        raise ValueError("stop strings cannot be combined with tool calls")
    if hasattr(engine, "generate_turns") and on_round is None:
        return _generate_overlapped(
            engine,
            tools,
            prompts,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seeds=seeds,
            between_steps=between_steps,
        )
    return _generate_in_rounds(
        engine,
        tools,
        prompts,
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seeds=seeds,
        between_steps=between_steps,
        on_round=on_round,
    )


def _wants_call(row: _Trajectory, tools: ToolBox, max_tokens: int) -> bool:
    """Whether `row`, which just finished a turn, stops at a call that should run; if not, its
    finish reason is settled."""
    if row.finish_reason != "stop_string":
        return False
    if row.calls >= tools.cfg.max_turns:
        row.finish_reason = "stop"  # past max_turns: ends at the call, unanswered
        return False
    if row.model_tokens >= max_tokens:
        row.finish_reason = "length"
        return False
    return True


def _generate_overlapped(
    engine: Any,
    tools: ToolBox,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seeds: Sequence[Sequence[int]] | None,
    between_steps: BetweenSteps | None,
) -> list[list[Sample]]:
    rows = [_Trajectory(prompt) for prompt in prompts for _ in range(n)]

    def call_and_continue(row: _Trajectory) -> tuple[list[int], int]:
        span = tools.tokenizer.decode(row.tokens[row.span_start :], skip_special_tokens=False)
        (result,) = tools.run([tools.find_call(span)])
        row.insert(tools.result_tokens(result), result)
        return row.prompt + row.tokens, max_tokens - row.model_tokens

    with ThreadPoolExecutor(tools.threads, thread_name_prefix="tool-call") as calls:

        def on_finish(key: int, sample: Sample) -> Future[tuple[list[int], int]] | None:
            row = rows[key]
            row.take(sample, max_tokens - row.model_tokens)
            if not _wants_call(row, tools, max_tokens):
                return None
            return calls.submit(call_and_continue, row)

        engine.generate_turns(
            prompts,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=tools.stops,
            on_finish=on_finish,
            seeds=seeds,
            between_steps=between_steps,
        )
    done = [row.sample() for row in rows]
    return [done[i * n : (i + 1) * n] for i in range(len(prompts))]


def _generate_in_rounds(
    engine: Engine,
    tools: ToolBox,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seeds: Sequence[Sequence[int]] | None = None,
    between_steps: BetweenSteps | None = None,
    on_round: Callable[[], None] | None = None,
) -> list[list[Sample]]:
    rows = [_Trajectory(prompt) for prompt in prompts for _ in range(n)]
    row_seeds = None if seeds is None else [s for group in seeds for s in group]
    row_number = {id(row): k for k, row in enumerate(rows)}

    def generate(
        contexts: list[list[int]], n: int, max_tokens: int, seeds: list[list[int]] | None
    ) -> list[list[Sample]]:
        return engine.generate(
            contexts,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seeds=seeds,
            between_steps=between_steps,
            stop=tools.stops,
        )

    first = generate(prompts, n, max_tokens, None if seeds is None else [list(s) for s in seeds])
    for row, out in zip(rows, (s for group in first for s in group), strict=True):
        row.take(out, max_tokens)
    while True:
        calling = [r for r in rows if _wants_call(r, tools, max_tokens)]
        if not calling:
            break
        spans = tools.tokenizer.batch_decode(
            [r.tokens[r.span_start :] for r in calling], skip_special_tokens=False
        )
        results = tools.run([tools.find_call(text) for text in spans])
        for row, result in zip(calling, results, strict=True):
            row.insert(tools.result_tokens(result), result)
        if on_round is not None:
            on_round()
        budget = max(max_tokens - r.model_tokens for r in calling)
        turn_seeds = (
            None
            if row_seeds is None
            else [[turn_seed(row_seeds[row_number[id(r)]], r.calls)] for r in calling]
        )
        outs = generate([r.prompt + r.tokens for r in calling], 1, budget, turn_seeds)
        for row, (out,) in zip(calling, outs, strict=True):
            row.take(out, max_tokens - row.model_tokens)
    done = [row.sample() for row in rows]
    return [done[i * n : (i + 1) * n] for i in range(len(prompts))]
