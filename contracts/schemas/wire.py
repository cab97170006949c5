"""The wire encoding: each message as Redis stream fields. Scalars travel as one small JSON field
(`meta`); token ids and log-probs as packed little-endian int32 / float32 arrays, never as JSON
lists; nothing is pickled. Decoding checks the schema version and kind, then the values
(`checks`), and raises `SchemaError` for anything that does not decode."""

from __future__ import annotations

import json
from array import array
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from contracts.schemas.checks import check_group_lengths, check_group_values
from contracts.schemas.messages import (
    ControlRequest,
    EvalResult,
    PromptJob,
    Response,
    RolloutGroup,
    ScoredGroup,
)
from contracts.schemas.parsing import SMALL_JSON_BYTES, SchemaError, parse_json
from contracts.schemas.signed_jobs import job_message, sign_job
from contracts.signing import SigningKey, WeightKey, signature_holds

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
    check_group_lengths(group)
    check_group_values(group)
    return group


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
