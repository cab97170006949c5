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

The package, by concern: `messages` (the models and their bounds), `wire` (stream fields, the
schema version), `checks` (a decoded group's values and sizes), `signed_jobs` (the learner's
signature on a job) and `parsing` (bounded JSON, `SchemaError`). Import from here.
"""

from __future__ import annotations

from contracts.schemas.checks import (
    MAX_LOGPROB,
    check_group_lengths,
    check_group_values,
    check_sizes,
    check_vocabulary,
)
from contracts.schemas.messages import (
    MAX_INDEX,
    MAX_PROBLEMS,
    MAX_SAMPLES,
    MAX_TOKENS,
    MAX_TOOL_CALLS,
    CheckpointRequest,
    ControlRequest,
    EvalResult,
    EvalTag,
    FinishReason,
    Index,
    PauseRequest,
    PromptJob,
    Response,
    RestoreRequest,
    RolloutGroup,
    ScoredGroup,
    Seconds,
    Tokens,
)
from contracts.schemas.parsing import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    SMALL_JSON_BYTES,
    SchemaError,
    parse_json,
)
from contracts.schemas.signed_jobs import (
    check_job_signature,
    job_message,
    sign_job,
)
from contracts.schemas.wire import (
    SCHEMA_VERSION,
    decode_control_request,
    decode_eval_result,
    decode_group,
    decode_job,
    decode_scored_group,
    encode_eval_result,
    encode_group,
    encode_job,
    group_id_of_fields,
    is_evaluation,
    job_signed,
)

__all__ = [
    "MAX_INDEX",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_LOGPROB",
    "MAX_PROBLEMS",
    "MAX_SAMPLES",
    "MAX_TOKENS",
    "MAX_TOOL_CALLS",
    "SCHEMA_VERSION",
    "SMALL_JSON_BYTES",
    "CheckpointRequest",
    "ControlRequest",
    "EvalResult",
    "EvalTag",
    "FinishReason",
    "Index",
    "PauseRequest",
    "PromptJob",
    "Response",
    "RestoreRequest",
    "RolloutGroup",
    "SchemaError",
    "ScoredGroup",
    "Seconds",
    "Tokens",
    "check_group_lengths",
    "check_group_values",
    "check_job_signature",
    "check_sizes",
    "check_vocabulary",
    "decode_control_request",
    "decode_eval_result",
    "decode_group",
    "decode_job",
    "decode_scored_group",
    "encode_eval_result",
    "encode_group",
    "encode_job",
    "group_id_of_fields",
    "is_evaluation",
    "job_message",
    "job_signed",
    "parse_json",
    "sign_job",
]
