"""Versioned message schemas and their compact wire encoding.

One message = one prompt group (ARCHITECTURE.md): a `PromptJob` issued by the feeder grows into a
`RolloutGroup` (G responses + behaviour log-probs + the policy version that generated them) and then
into a `ScoredGroup` (the same group with every response judged). Each state has its own type and
its own wire kind, so a consumer never meets a half-filled message: the gatekeeper and the learner
decode scored groups only, and an unscored one is a schema error (dead-lettered), not an assert.
An evaluation job (`PromptJob.eval` set) travels the same way and is turned by the gatekeeper into
an `EvalResult` for the learner's evaluation lane instead of being trained. Scalars travel as one
small JSON field; token ids and log-probs travel as packed little-endian int32 / float32 arrays,
never as JSON lists. Nothing is pickled. Anything that does not decode raises `SchemaError`, which
the stream layer turns into a dead letter with the reason.

A decoded group's numbers are checked too, so no consumer trains on them: rewards and scores
must be finite, behaviour log-probs finite and not above zero, token ids not negative. The upper
bound of token ids (the model's vocabulary) is not known here; the learner checks it with
`check_vocabulary` before training.
"""

from __future__ import annotations

import json
import math
from array import array
from typing import Annotated, Any, Literal, TypeVar

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from contracts.signing import SigningKey, WeightKey, sign, signature_holds

SCHEMA_VERSION = 7
"""2: the stream field `gid` became `group_id`, `PromptJob.issued_version` became `policy_version`.
3: `PromptJob.eval` (evaluation jobs) and the `EvalResult` message.
4: `EvalResult.policy_version` became `policy_version_min` / `policy_version_max`.
5: `PromptJob.policy_version` is `issued_version` again: one message (a group, which carries its
job) held two different `policy_version`s; `policy_version` now always names the version that
generated something (a group, a response's range, an evaluation round).
6: scored groups are their own message kind (`scored`, `ScoredGroup`) with every score field
required; a `group` carries no score fields.
7: an `EvalResult` carries its signed job (its `group_id` and `tag` are the job's), so a dead
letter tells the run's own evaluation results from planted ones as it does groups."""

FinishReason = Literal["stop", "length", "abort"]


class SchemaError(ValueError):
    """A stream entry could not be decoded into a valid message."""


MAX_JSON_BYTES = 64 * 2**20
"""Largest JSON text any reader parses (a group's meta holds its responses' text tails: kilobytes;
a Redis value can be 512 MB)."""
SMALL_JSON_BYTES = 64 * 2**10
"""Largest heartbeat, final-stats field, metrics record or weight announcement a reader parses
(each is under 4 KB): one planted with a role's password costs a poll a bounded parse."""
MAX_JSON_DEPTH = 32
"""Deepest nesting any reader accepts: our messages nest at most 4 levels."""


def _depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in item if isinstance(child, dict | list))
    return deepest


def parse_json(raw: bytes | str, what: str = "value", max_bytes: int | None = None) -> object:
    """Parse JSON text that Redis or a request hands us, in time linear in its size: pydantic-
    core's parser (Rust; it refuses nesting past about 200 levels by itself), then the nesting
    checked against MAX_JSON_DEPTH on the parsed value. Every failure is a `SchemaError` (a
    ValueError) naming `what`, so a reader that skips what does not parse is never crashed or
    stalled by a value (the regex pre-scan this replaced took 1.8 s on 30 KB of escaped quotes;
    `json.loads` raised RecursionError on 2 KB of brackets). NaN and Infinity parse, as
    `json.dumps` writes them. `max_bytes` lowers the size limit for small kinds of value
    (`SMALL_JSON_BYTES`)."""
    data = raw.encode() if isinstance(raw, str) else raw
    limit = MAX_JSON_BYTES if max_bytes is None else min(max_bytes, MAX_JSON_BYTES)
    if len(data) > limit:
        raise SchemaError(f"{what} is {len(data)} bytes of JSON, over {limit}")
    try:
        value = pydantic_core.from_json(data, allow_inf_nan=True)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise SchemaError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
        raise SchemaError(f"{what} is not valid JSON: {exc}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise SchemaError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


MAX_SAMPLES = 4096
"""Most responses a group or an evaluation problem may ask for (the paper's groups hold 16): one
planted job must not make a replica generate for ever."""
MAX_TOKENS = 1 << 24
"""Most token ids in one prompt or response: 16M, past any context window (the hostile-reward
test sends responses of 1.1M tokens), and at most 64 MB of packed ids."""
MAX_PROBLEMS = 10_000_000
"""Most distinct problems an evaluation round may count."""

MAX_INDEX = 2**31 - 1
"""Largest policy version, step, prompt index or data epoch a message may carry: a run
publishing one version a millisecond would need 24 days to reach it. A planted 2**70 fails
decoding (and is dead-lettered) instead of overflowing a tensor in the learner's batch."""
Index = Annotated[int, Field(ge=0, le=MAX_INDEX)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A duration or a wall-clock time: finite and not negative (NaN would poison every mean)."""
Tokens = Annotated[list[int], Field(max_length=MAX_TOKENS)]
MAX_TOOL_CALLS = 64
"""Most tool calls one response may record (`rollout.tools.max_turns` is at most 64)."""


class EvalTag(_Msg):
    """Marks a prompt job as evaluation: sampled with the eval settings, never trained, tallied
    into its round (docs/algorithm.md s7, avg@k)."""

    round_step: Index
    """The learner step whose weights the round evaluates (0 = the base model)."""
    policy_version: Index
    """The policy version published at that step."""
    problem: int = Field(ge=0, lt=MAX_PROBLEMS)
    """Index of this problem among the round's distinct problems."""
    problems: int = Field(ge=1, le=MAX_PROBLEMS)
    """Distinct problems in the round (duplicates in the eval file are merged)."""
    samples: int = Field(ge=1, le=MAX_SAMPLES)
    """Responses to generate (k of avg@k)."""
    rl_seconds: Seconds = 0.0
    """When the evaluated weights existed: seconds of training since the run's first step."""


class PromptJob(_Msg):
    """Work for a rollout replica: generate `group_size` responses to one prompt (or, for an
    evaluation job, `eval.samples` responses with the eval sampling settings)."""

    group_id: str
    """Unique per issued job (`<run>-<cursor>`), the identity the ledger counts."""
    prompt_index: Index
    """Row of the training set (data cursor position modulo epoch)."""
    data_epoch: Index = 0
    """Pass over the training set the job was issued in (the prompt history records it).
    Optional with a default, so jobs encoded before it existed still decode."""
    prompt_ids: Tokens
    ground_truth: str
    data_source: str = ""
    issued_version: Index
    """The learner's policy version when it issued the job; a replica generates with at least this
    version, so no group starts older than the admission bound allows. (The version a group was
    generated by is `RolloutGroup.policy_version`.)"""
    issued_at: Seconds
    eval: EvalTag | None = None
    """Set on evaluation jobs only."""
    extra_info: dict[str, JsonValue] = Field(default_factory=dict)
    """The data row's `extra_info`, for a `reward.function` (training and evaluation jobs).
    Optional with a default, so jobs encoded before it existed still decode.
    Values JSON cannot hold (a parquet timestamp, say) travel as their `str()`."""
    sig: str = Field("", max_length=128)
    """The learner's Ed25519 signature of everything else in the job (`job_message`), hex; the
    reward workers and the learner refuse a group whose job it does not verify, so no other
    credential can choose the prompts or the ground truths. Empty where nothing is signed (the
    in-process loop, jobs built by hand)."""

    @field_validator("extra_info", mode="before")
    @classmethod
    def _json_safe(cls, value: object) -> object:
        if isinstance(value, dict):
            return json.loads(json.dumps(value, default=str))
        return value


class Response(_Msg):
    token_ids: Tokens
    logprobs: list[float]
    """Behaviour log-probs of each sampled token under the weights that sampled it."""
    finish_reason: FinishReason
    text: str = ""
    versions: tuple[Index, Index] | None = None
    """(lowest, highest) policy version that sampled its tokens; they differ when the weights
    changed while it was generated (an in-flight update, or a reload of an older checkpoint after
    a failed broadcast). None: not recorded."""
    tool_spans: list[tuple[int, int]] = Field(default_factory=list, max_length=MAX_TOOL_CALLS)
    """[start, end) of each tool result inserted among `token_ids` (`rollout.tools`): context
    the model did not sample, with log-prob 0; the learner gives them loss mask 0. Empty when
    the model sampled every token."""
    tool_calls: int = Field(0, ge=0, le=MAX_TOOL_CALLS)
    tool_errors: int = Field(0, ge=0, le=MAX_TOOL_CALLS)
    """Calls that returned an error text (time-outs included)."""
    tool_timeouts: int = Field(0, ge=0, le=MAX_TOOL_CALLS)
    tool_seconds: Seconds = 0.0

    @model_validator(mode="after")
    def _spans_inside(self) -> Response:
        end = 0
        for start, stop in self.tool_spans:
            if not end <= start < stop <= len(self.token_ids):
                raise ValueError(
                    f"tool_spans {self.tool_spans} are not increasing, non-empty spans inside "
                    f"the response's {len(self.token_ids)} tokens"
                )
            end = stop
        return self

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled: what `max_response_len` and the overlong penalty count."""
        return len(self.token_ids) - sum(stop - start for start, stop in self.tool_spans)


class RolloutGroup(_Msg):
    """A prompt job's G responses, as the rollout replica generated them (not yet judged)."""

    job: PromptJob
    policy_version: Index
    """The lowest version of the weights that generated any token of this group: staleness and
    the off-policy correction are judged by it (`Response.versions` has the range). An evaluation
    group takes no in-flight update: all its tokens come from this version."""
    replica_id: str
    responses: list[Response] = Field(max_length=MAX_SAMPLES)
    gen_seconds: Seconds = 0.0


class ScoredGroup(RolloutGroup):
    """A `RolloutGroup` after the reward service: every response judged. The gatekeeper reads
    these and forwards the kept ones unchanged; the learner trains on them."""

    scores: list[float]
    """Verifier score per response (+1 / -1)."""
    acc: list[bool]
    rewards: list[float]
    """Shaped reward per response (score + overlong penalty), placed on the last token."""
    preds: list[str]
    reward_timeouts: int = Field(0, ge=0)

    @classmethod
    def of(
        cls,
        group: RolloutGroup,
        *,
        scores: list[float],
        acc: list[bool],
        rewards: list[float],
        preds: list[str],
        reward_timeouts: int = 0,
    ) -> ScoredGroup:
        """`group` with its judgements (the responses are shared, not copied)."""
        return cls(
            **dict(group),
            scores=scores,
            acc=acc,
            rewards=rewards,
            preds=preds,
            reward_timeouts=reward_timeouts,
        )


class EvalResult(_Msg):
    """One evaluation job's outcome, as the gatekeeper forwards it to the evaluation lane: its
    job (signed by the learner, so the lane and a dead letter can tell it is the run's) and
    counts (the responses themselves are not needed to compute avg@k)."""

    job: PromptJob
    """The evaluation job this is the outcome of (`job.eval` is set)."""
    policy_version_min: Index
    """Lowest policy version that generated a token of the responses (at least the round's
    `tag.policy_version`: a replica may hold a newer one when it takes the job)."""
    policy_version_max: Index
    """Highest such version: the policy the result measures. Equal to `policy_version_min`
    unless the replica took a weight update mid-generation. An engine that receives broadcasts
    in the background (transformers; vLLM serving LoRA adapters) holds one policy through an
    evaluation batch; vLLM receiving full weights takes updates there as in training batches,
    so its results may span versions (`rollout/service.py`)."""
    correct: int = Field(ge=0)
    samples: int = Field(ge=1, le=MAX_SAMPLES)
    response_tokens: int = Field(ge=0)
    truncated: int = Field(ge=0)
    """Responses cut at `rollout.max_response_len`."""

    @model_validator(mode="after")
    def _an_evaluation_job(self) -> EvalResult:
        if self.job.eval is None:
            raise ValueError(f"job {self.job.group_id} is not an evaluation job")
        return self

    @property
    def group_id(self) -> str:
        return self.job.group_id

    @property
    def tag(self) -> EvalTag:
        """The round and problem the result belongs to (its job's `eval`)."""
        assert self.job.eval is not None  # `_an_evaluation_job`
        return self.job.eval

    @property
    def policy_version(self) -> int:
        """The policy the result measures (`policy_version_max`)."""
        return self.policy_version_max

    @classmethod
    def of(cls, group: ScoredGroup) -> EvalResult:
        if group.job.eval is None:
            raise SchemaError(f"group {group.job.group_id} is not an evaluation group")
        held = (group.policy_version, group.policy_version)  # responses that recorded no range
        ranges = [r.versions or held for r in group.responses]
        return cls(
            job=group.job,
            policy_version_min=min(low for low, _ in ranges),
            policy_version_max=max(high for _, high in ranges),
            correct=sum(bool(a) for a in group.acc),
            samples=len(group.responses),
            response_tokens=sum(len(r.token_ids) for r in group.responses),
            truncated=sum(r.finish_reason == "length" for r in group.responses),
        )


# ---------------------------------------------------------------------------------------------
# operator requests (the control hash, one field per kind; carried out by the learner at its
# next step boundary)


class PauseRequest(_Msg):
    """Stop taking training steps until the request is removed (POST /resume)."""

    kind: Literal["pause"] = "pause"
    at: Seconds = 0.0


class CheckpointRequest(_Msg):
    """Save a checkpoint now; `keep` exempts it from retention."""

    kind: Literal["checkpoint"] = "checkpoint"
    keep: bool = False
    at: Seconds = 0.0


class RestoreRequest(_Msg):
    """Load checkpoint `step` and continue from it (new policy versions keep rising)."""

    kind: Literal["restore"] = "restore"
    step: int = Field(ge=0)
    at: Seconds = 0.0


ControlRequest = Annotated[
    PauseRequest | CheckpointRequest | RestoreRequest, Field(discriminator="kind")
]


# ---------------------------------------------------------------------------------------------
# wire encoding


def _pack_ints(values: list[int]) -> bytes:
    return array("i", values).tobytes()


def _pack_floats(values: list[float]) -> bytes:
    return array("f", values).tobytes()


def _unpack(kind: str, raw: bytes, what: str) -> list[int] | list[float]:
    arr = array(kind)
    if len(raw) % arr.itemsize:
        raise SchemaError(
            f"{what}: {len(raw)} bytes is not a whole number of {arr.itemsize}-byte items"
        )
    arr.frombytes(raw)
    return arr.tolist()


def job_message(job: PromptJob) -> bytes:
    """What the learner signs of a job: every field but the signature, as canonical JSON (the
    same bytes from the job as issued and from its copy inside a group, whoever re-encoded it)."""
    fields = job.model_dump(mode="json", exclude={"sig"})
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_job(job: PromptJob, key: SigningKey) -> PromptJob:
    return job.model_copy(update={"sig": sign(key, job_message(job))})


def check_job_signature(message: RolloutGroup | EvalResult, key: WeightKey) -> None:
    """SchemaError unless the job of a group or an evaluation result carries the learner's
    signature (`PromptJob.sig`)."""
    job = message.job
    if not signature_holds(key, job_message(job), job.sig or None):
        what = "evaluation result" if isinstance(message, EvalResult) else "group"
        raise SchemaError(
            f"{what} {job.group_id}: its job is not signed by this run's learner (a job, a "
            "prompt or a ground truth written by someone else)"
        )


def job_signed(fields: dict[bytes, bytes], key: WeightKey) -> bool:
    """Whether a job's, group's or evaluation result's stream fields carry a job the learner
    signed. How a dead letter tells the run's own entries from planted ones. Only the job is
    read (the rest may be what failed to decode, or a message of another schema version from
    the run's own learner); a job that is not there, or not valid, or not signed, is not the
    run's."""
    kind = fields.get(b"kind")
    try:
        meta = parse_json(fields[b"meta"], "meta")
        raw_job = meta if kind == b"job" else meta["job"]  # type: ignore[index]
        if not isinstance(raw_job, dict):
            return False
        prompt_ids = _unpack("i", fields[b"prompt_ids"], "prompt_ids")
        job = PromptJob.model_validate({**raw_job, "prompt_ids": prompt_ids})
    except (KeyError, TypeError, ValueError):  # SchemaError and ValidationError are ValueErrors
        return False
    return signature_holds(key, job_message(job), job.sig or None)


def encode_job(job: PromptJob, key: SigningKey | None = None) -> dict[str, bytes]:
    """A job as stream fields; signed with `key` (the learner's) when given."""
    if key is not None:
        job = sign_job(job, key)
    meta = job.model_dump(exclude={"prompt_ids"})
    return {
        "v": str(SCHEMA_VERSION).encode(),
        "kind": b"job",
        "group_id": job.group_id.encode(),
        "meta": json.dumps(meta, separators=(",", ":")).encode(),
        "prompt_ids": _pack_ints(job.prompt_ids),
    }


def encode_group(group: RolloutGroup) -> dict[str, bytes]:
    meta = group.model_dump(exclude={"job": {"prompt_ids"}, "responses": True})
    meta["responses"] = [
        {
            "n": len(r.token_ids),
            "finish_reason": r.finish_reason,
            "text": r.text,
            "versions": r.versions,
            **(_tool_fields(r) if r.tool_calls or r.tool_spans else {}),
        }
        for r in group.responses
    ]
    tokens: list[int] = []
    logprobs: list[float] = []
    for r in group.responses:
        if len(r.token_ids) != len(r.logprobs):
            raise SchemaError(
                f"group {group.job.group_id}: response has {len(r.token_ids)} tokens but "
                f"{len(r.logprobs)} log-probs"
            )
        tokens.extend(r.token_ids)
        logprobs.extend(r.logprobs)
    return {
        "v": str(SCHEMA_VERSION).encode(),
        "kind": b"scored" if isinstance(group, ScoredGroup) else b"group",
        "group_id": group.job.group_id.encode(),
        "meta": json.dumps(meta, separators=(",", ":")).encode(),
        "prompt_ids": _pack_ints(group.job.prompt_ids),
        "tokens": _pack_ints(tokens),
        "logprobs": _pack_floats(logprobs),
    }


_TOOL_FIELDS = ("tool_spans", "tool_calls", "tool_errors", "tool_timeouts", "tool_seconds")


def _tool_fields(response: Response) -> dict[str, Any]:
    return {name: getattr(response, name) for name in _TOOL_FIELDS}


def encode_eval_result(result: EvalResult) -> dict[str, bytes]:
    """An evaluation result as stream fields: its job as a group's is (prompt ids packed)."""
    meta = result.model_dump(exclude={"job": {"prompt_ids"}})
    return {
        "v": str(SCHEMA_VERSION).encode(),
        "kind": b"eval",
        "group_id": result.group_id.encode(),
        "meta": json.dumps(meta, separators=(",", ":")).encode(),
        "prompt_ids": _pack_ints(result.job.prompt_ids),
    }


def decode_eval_result(fields: dict[bytes, bytes]) -> EvalResult:
    meta = _header(fields, "eval")
    job = meta.get("job")
    if not isinstance(job, dict):
        raise SchemaError("missing job")
    job["prompt_ids"] = _unpack("i", fields[b"prompt_ids"], "prompt_ids")
    try:
        return EvalResult.model_validate(meta)
    except ValidationError as exc:
        raise SchemaError(f"invalid eval result: {_first_error(exc)}") from None


def _header(
    fields: dict[bytes, bytes], kind: str, packed: tuple[bytes, ...] = (b"prompt_ids",)
) -> dict[str, object]:
    version = fields.get(b"v")
    if version != str(SCHEMA_VERSION).encode():
        raise SchemaError(f"schema version {version!r}, expected {SCHEMA_VERSION}")
    if fields.get(b"kind") != kind.encode():
        raise SchemaError(f"message kind {fields.get(b'kind')!r}, expected {kind!r}")
    for name in (b"meta", *packed):
        if name not in fields:
            raise SchemaError(f"missing field {name.decode()!r}")
    meta = parse_json(fields[b"meta"], "meta")
    if not isinstance(meta, dict):
        raise SchemaError("meta is not a JSON object")
    return meta


def decode_job(fields: dict[bytes, bytes]) -> PromptJob:
    meta = _header(fields, "job")
    meta["prompt_ids"] = _unpack("i", fields[b"prompt_ids"], "prompt_ids")
    try:
        return PromptJob.model_validate(meta)
    except ValidationError as exc:
        raise SchemaError(f"invalid prompt job: {_first_error(exc)}") from None


def decode_group(fields: dict[bytes, bytes]) -> RolloutGroup:
    """A generated group (kind `group`), as the reward service reads it."""
    return _decode_group(fields, "group", RolloutGroup)


def decode_scored_group(fields: dict[bytes, bytes]) -> ScoredGroup:
    """A judged group (kind `scored`), as the gatekeeper and the learner read it."""
    if fields.get(b"kind") == b"group":
        group_id = (group_id_of_fields(fields) or b"?").decode(errors="replace")
        raise SchemaError(f"group {group_id} is unscored (it has not passed the reward service)")
    return _decode_group(fields, "scored", ScoredGroup)


_Group = TypeVar("_Group", bound=RolloutGroup)


def _decode_group(fields: dict[bytes, bytes], kind: str, model: type[_Group]) -> _Group:
    meta = _header(fields, kind)
    for name in (b"tokens", b"logprobs"):
        if name not in fields:
            raise SchemaError(f"missing field {name.decode()!r}")
    tokens = _unpack("i", fields[b"tokens"], "tokens")
    logprobs = _unpack("f", fields[b"logprobs"], "logprobs")
    if len(tokens) != len(logprobs):
        raise SchemaError(f"{len(tokens)} tokens but {len(logprobs)} log-probs")
    heads = meta.get("responses")
    if not isinstance(heads, list) or not heads:
        raise SchemaError("group has no responses")
    responses, offset = [], 0
    for i, head in enumerate(heads):
        if not isinstance(head, dict) or not isinstance(head.get("n"), int) or head["n"] < 0:
            raise SchemaError(f"response {i}: missing or invalid token count")
        n = head["n"]
        if offset + n > len(tokens):
            raise SchemaError(f"response {i}: token count {n} runs past the packed arrays")
        responses.append(
            {
                "token_ids": tokens[offset : offset + n],
                "logprobs": logprobs[offset : offset + n],
                "finish_reason": head.get("finish_reason"),
                "text": head.get("text", ""),
                "versions": head.get("versions"),
                **{k: head[k] for k in _TOOL_FIELDS if k in head},
            }
        )
        offset += n
    if offset != len(tokens):
        raise SchemaError(f"{len(tokens) - offset} packed tokens belong to no response")
    meta["responses"] = responses
    job = meta.get("job")
    if not isinstance(job, dict):
        raise SchemaError("missing job")
    job["prompt_ids"] = _unpack("i", fields[b"prompt_ids"], "prompt_ids")
    try:
        group = model.model_validate(meta)
    except ValidationError as exc:
        raise SchemaError(f"invalid {kind} group: {_first_error(exc)}") from None
    _check_group_lengths(group)
    _check_group_values(group)
    return group


def _check_group_lengths(group: RolloutGroup) -> None:
    if not isinstance(group, ScoredGroup):
        return
    n = len(group.responses)
    for name in ("scores", "acc", "rewards", "preds"):
        values = getattr(group, name)
        if len(values) != n:
            raise SchemaError(
                f"group {group.job.group_id}: {name} has {len(values)} entries for {n} responses"
            )


MAX_LOGPROB = 1e-4
"""Largest behaviour log-prob accepted. A sampled token's probability is at most 1 (log-prob 0);
the slack absorbs float32 rounding in an engine's log-softmax or nucleus renormalisation, which
can put a near-certain token a hair above 0. Anything larger is a broken engine."""


def _check_group_values(group: RolloutGroup) -> None:
    """Rewards and scores finite, behaviour log-probs finite and <= `MAX_LOGPROB`, token ids >= 0.

    One NaN here would reach every weight through the advantages or the importance ratio. What
    this does NOT catch: finite but wrong values (a log-prob of -3 for a token sampled with
    probability 0.9), and token ids past the model's vocabulary (`check_vocabulary`).
    """
    for name in ("rewards", "scores"):
        values: list[float] = getattr(group, name, [])
        for i, value in enumerate(values):
            if not math.isfinite(value):
                raise SchemaError(f"response {i} {name[:-1]} is {value}")
    for i, response in enumerate(group.responses):
        logprobs = response.logprobs
        # sum() is NaN or infinite when any term is (float32 values cannot overflow a float64 sum),
        # so the usual case costs two C-speed passes; the loop only names the offender.
        if logprobs and not (math.isfinite(sum(logprobs)) and max(logprobs) <= MAX_LOGPROB):
            for j, value in enumerate(logprobs):
                if not math.isfinite(value):
                    raise SchemaError(f"response {i} logprob {j} is {value}")
                if value > MAX_LOGPROB:
                    raise SchemaError(
                        f"response {i} logprob {j} is {value:g}, above 0 (a log-prob is never "
                        "positive)"
                    )
    _check_token_range(group, low=0, high=None, what="token ids are never negative")


def check_vocabulary(group: RolloutGroup, vocab_size: int) -> None:
    """Every prompt and response token id is in [0, vocab_size) (the model's embedding rows).

    Checked by the learner, which knows the model: an id past the embedding is an index error on
    CPU and a device-side assert that kills the process on CUDA.
    """
    _check_token_range(
        group, low=0, high=vocab_size, what=f"outside the model's vocabulary of {vocab_size} ids"
    )


def check_sizes(
    group: RolloutGroup, *, max_prompt_tokens: int, max_response_tokens: int, max_responses: int
) -> None:
    """The group is no larger than the run could have generated: its prompt within
    `data.max_prompt_len`, each response within `rollout.max_response_len` plus what tools may
    insert, no more responses than a job asks for. Checked by the learner before it batches: a
    group planted with a million-token response would otherwise be padded into every row of a
    batch (memory the learner does not have) instead of dead-lettered."""
    where = f"group {group.job.group_id}"
    if len(group.job.prompt_ids) > max_prompt_tokens:
        raise SchemaError(
            f"{where}: a prompt of {len(group.job.prompt_ids)} tokens, over the run's "
            f"{max_prompt_tokens}"
        )
    if len(group.responses) > max_responses:
        raise SchemaError(
            f"{where}: {len(group.responses)} responses, over the {max_responses} a job asks for"
        )
    for i, r in enumerate(group.responses):
        if len(r.token_ids) > max_response_tokens:
            raise SchemaError(
                f"{where}: response {i} has {len(r.token_ids)} tokens, over the run's "
                f"{max_response_tokens}"
            )


def _check_token_range(group: RolloutGroup, *, low: int, high: int | None, what: str) -> None:
    rows = [("prompt", group.job.prompt_ids)] + [
        (f"response {i}", r.token_ids) for i, r in enumerate(group.responses)
    ]
    for where, ids in rows:
        if not ids or (min(ids) >= low and (high is None or max(ids) < high)):
            continue
        for j, token in enumerate(ids):
            if token < low or (high is not None and token >= high):
                raise SchemaError(f"{where} token {j} is id {token}, {what}")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']}" + (
        f" ({len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    )


def is_evaluation(fields: dict[bytes, bytes]) -> bool:
    """An evaluation job, group or result, read from its stream fields without decoding it whole
    (it dies in the evaluation lane of the ledger; the drain leaves it to run)."""
    if fields.get(b"kind") == b"eval":
        return True
    try:
        meta: Any = parse_json(fields[b"meta"], "meta")
        return bool(meta.get("eval") or meta.get("job", {}).get("eval"))
    except (KeyError, ValueError, AttributeError, TypeError):  # SchemaError is a ValueError
        return False


def group_id_of_fields(fields: dict[bytes, bytes]) -> bytes | None:
    """The group id of a job or group, read from its stream fields without decoding it whole;
    None for an entry that carries none (garbage injected into a stream)."""
    if fields.get(b"group_id"):
        return fields[b"group_id"]
    try:
        meta: Any = parse_json(fields[b"meta"], "meta")
        group_id = meta.get("group_id") or meta.get("job", {}).get("group_id")
        return str(group_id).encode() if group_id else None
    except (KeyError, ValueError, AttributeError, TypeError):  # SchemaError is a ValueError
        return None


_CONTROL_REQUEST: TypeAdapter[ControlRequest] = TypeAdapter(ControlRequest)


def decode_control_request(raw: bytes | str) -> ControlRequest:
    """An operator request as stored in the control hash (raises pydantic's ValidationError, or
    SchemaError past `SMALL_JSON_BYTES`: every request is under 1 KB)."""
    if len(raw) > SMALL_JSON_BYTES:
        raise SchemaError(f"control request is {len(raw)} bytes, over {SMALL_JSON_BYTES}")
    return _CONTROL_REQUEST.validate_json(raw)
