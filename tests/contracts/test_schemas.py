"""Wire encoding of jobs and groups: round trips, compactness, and precise decode errors."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import pytest

from contracts.schemas import (
    MAX_INDEX,
    MAX_JSON_DEPTH,
    SMALL_JSON_BYTES,
    PromptJob,
    Response,
    RolloutGroup,
    SchemaError,
    ScoredGroup,
    check_vocabulary,
    decode_eval_result,
    decode_group,
    decode_job,
    decode_scored_group,
    encode_group,
    encode_job,
    group_id_of_fields,
    is_evaluation,
    parse_json,
    parsing,
)
from tests.helpers import judged


def make_group(n: int = 4, length: int = 50) -> RolloutGroup:
    job = PromptJob(
        group_id="run-7",
        prompt_index=7,
        prompt_ids=[1, 2, 3],
        ground_truth="42",
        issued_version=3,
        issued_at=1.0,
    )
    responses = [
        Response(
            token_ids=list(range(i, i + length)),
            logprobs=[-0.5 * (j % 3) for j in range(length)],
            finish_reason="stop",
            text=f"Answer: {i}",
        )
        for i in range(n)
    ]
    return RolloutGroup(job=job, policy_version=3, replica_id="r0", responses=responses)


def as_wire(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    return {k.encode(): v for k, v in fields.items()}


def test_job_round_trip() -> None:
    job = make_group().job
    assert decode_job(as_wire(encode_job(job))) == job


def test_group_round_trip_scored() -> None:
    g = ScoredGroup.of(
        make_group(),
        scores=[1.0, -1.0, 1.0, -1.0],
        acc=[True, False, True, False],
        rewards=[1.0, -1.5, 1.0, -1.0],
        preds=["0", "x", "2", "y"],
    )
    back = decode_scored_group(as_wire(encode_group(g)))
    assert back == g and isinstance(back, ScoredGroup)


def test_each_pipeline_state_decodes_only_as_itself() -> None:
    """A generated group is no scored group and a scored one no generated group: the gatekeeper
    and the learner name the first, and the reward service the second, when one reaches them."""
    generated = as_wire(encode_group(make_group()))
    assert decode_group(generated) == make_group()
    with pytest.raises(SchemaError, match="group run-7 is unscored"):
        decode_scored_group(generated)
    scored = as_wire(encode_group(judged(make_group())))
    with pytest.raises(SchemaError, match="message kind b'scored', expected 'group'"):
        decode_group(scored)


def test_a_scored_group_missing_a_judgement_does_not_decode() -> None:
    fields = as_wire(encode_group(judged(make_group())))
    meta = json.loads(fields[b"meta"])
    del meta["acc"]
    fields[b"meta"] = json.dumps(meta).encode()
    with pytest.raises(SchemaError, match="invalid scored group: acc: Field required"):
        decode_scored_group(fields)


def test_arrays_are_packed_not_json() -> None:
    fields = encode_group(make_group(n=16, length=500))
    assert len(fields["tokens"]) == 16 * 500 * 4 and len(fields["logprobs"]) == 16 * 500 * 4
    assert b"logprobs" not in fields["meta"]  # no JSON list of floats


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f.update({b"v": b"99"}), "schema version"),
        (lambda f: f.update({b"meta": b"\xff\xfe"}), "not valid JSON"),
        (lambda f: f.pop(b"tokens"), "missing field 'tokens'"),
        (lambda f: f.update({b"tokens": b"\x00\x01\x02"}), "not a whole number"),
        (lambda f: f.update({b"logprobs": f[b"logprobs"][:-4]}), "log-probs"),
        (lambda f: f.update({b"kind": b"job"}), "message kind"),
    ],
)
def test_decode_errors_say_what_is_wrong(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    fields = as_wire(encode_group(make_group()))
    mutate(fields)
    with pytest.raises(SchemaError, match=message):
        decode_group(fields)


def test_group_with_missing_response_is_rejected() -> None:
    fields = as_wire(encode_group(make_group()))
    meta = json.loads(fields[b"meta"])
    meta["responses"].pop()
    fields[b"meta"] = json.dumps(meta).encode()
    with pytest.raises(SchemaError, match="belong to no response"):
        decode_group(fields)


def test_scores_must_match_responses() -> None:
    fields = as_wire(encode_group(judged(make_group())))
    meta = json.loads(fields[b"meta"])
    meta["rewards"] = [1.0]
    fields[b"meta"] = json.dumps(meta).encode()
    with pytest.raises(SchemaError, match="rewards has 1 entries for 4 responses"):
        decode_scored_group(fields)


def _with(mutate: Callable[[ScoredGroup], object]) -> dict[bytes, bytes]:
    g = judged(make_group(), [True, False, True, False])
    mutate(g)
    return as_wire(encode_group(g))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda g: g.rewards.__setitem__(2, float("nan")), "response 2 reward is nan"),
        (lambda g: g.scores.__setitem__(0, float("inf")), "response 0 score is inf"),
        (
            lambda g: g.responses[1].logprobs.__setitem__(9, float("-inf")),
            "response 1 logprob 9 is -inf",
        ),
        (
            lambda g: g.responses[3].logprobs.__setitem__(0, 2.0),
            "response 3 logprob 0 is 2, above 0",
        ),
        (
            lambda g: g.job.prompt_ids.__setitem__(1, -1),
            "prompt token 1 is id -1, token ids are never negative",
        ),
    ],
)
def test_numbers_no_model_can_train_on_do_not_decode(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    """Every consumer of a group (reward worker, gatekeeper, learner)
    gets these checks from the decode."""
    with pytest.raises(SchemaError) as err:
        decode_scored_group(_with(mutate))
    assert str(err.value).startswith(message)


def test_check_vocabulary_names_the_first_id_past_the_embedding() -> None:
    g = make_group(length=50)  # response 3 holds ids 3..52
    check_vocabulary(g, vocab_size=53)
    with pytest.raises(
        SchemaError,
        match=r"^response 3 token 49 is id 52, outside the model's vocabulary of 52 ids$",
    ):
        check_vocabulary(g, vocab_size=52)


NESTED = b"[" * 2000 + b"]" * 2000  # 4 KB: json.loads raised RecursionError on it


@pytest.mark.parametrize(
    "decode", [decode_job, decode_group, decode_scored_group, decode_eval_result]
)
def test_json_nested_past_the_limit_is_a_schema_error_not_a_crash(decode) -> None:  # type: ignore[no-untyped-def]
    fields = as_wire(encode_group(judged(make_group())))
    fields[b"kind"] = {decode_job: b"job", decode_eval_result: b"eval"}.get(decode, b"scored")
    if decode is decode_group:
        fields[b"kind"] = b"group"
    fields[b"meta"] = NESTED
    with pytest.raises(SchemaError, match="meta nests deeper than 32 levels"):
        decode(fields)
    # What the dead-letter path reads from the same fields: nothing, and no exception.
    del fields[b"group_id"]
    assert group_id_of_fields(fields) is None
    assert is_evaluation(fields) is (decode is decode_eval_result)  # an eval result by its kind


def test_parse_json_bounds_size_and_depth_and_reads_brackets_in_strings_as_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    brackets_in_a_string = {"a": [1, {"b": "[" * 40 + '\\"[{'}]}
    assert parse_json(json.dumps(brackets_in_a_string)) == brackets_in_a_string
    deepest = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert isinstance(parse_json(deepest), list)
    with pytest.raises(SchemaError, match="heartbeat nests deeper than 32 levels"):
        parse_json(b"[" + deepest + b"]", "heartbeat")
    small = b"[" + b"0," * (SMALL_JSON_BYTES // 2) + b"0]"
    with pytest.raises(SchemaError, match=f"heartbeat is {len(small)} bytes of JSON, over 65536"):
        parse_json(small, "heartbeat", SMALL_JSON_BYTES)
    assert len(parse_json(small, "eval history")) == SMALL_JSON_BYTES // 2 + 1  # type: ignore[arg-type]
    monkeypatch.setattr(parsing, "MAX_JSON_BYTES", 8)
    with pytest.raises(SchemaError, match="eval history is 9 bytes of JSON, over 8"):
        parse_json(b"[1,2,3,4]", "eval history")


def test_parse_json_takes_time_linear_in_the_text() -> None:
    """30 KB of escaped quotes behind 40 brackets held the old pre-scan (a regex over strings)
    1.8 s, growing with the square of the size: 300 KB would take minutes. A heartbeat planted
    like that must cost a poll no more than any other value of its size."""
    planted = b"[" * 40 + b'"' + b'\\"' * 100_000  # 300 KB, never closed
    started = time.perf_counter()
    with pytest.raises(SchemaError, match="heartbeat is not valid JSON"):
        parse_json(planted, "heartbeat")
    assert time.perf_counter() - started < 1.0  # about 1 ms; the old scan: minutes
    assert parse_json(b'{"idle": NaN, "n": 12345678901234567890}') == {
        "idle": pytest.approx(float("nan"), nan_ok=True),
        "n": 12345678901234567890,
    }


def _job_meta(**changes: object) -> dict[bytes, bytes]:
    fields = as_wire(encode_job(make_group().job))
    meta = json.loads(fields[b"meta"])
    meta.update(changes)
    fields[b"meta"] = json.dumps(meta).encode()
    return fields


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {
                "eval": {
                    "round_step": 0,
                    "policy_version": 0,
                    "problem": 0,
                    "problems": 1,
                    "samples": 10**9,
                }
            },
            "eval.samples: Input should be less than or equal to 4096",
        ),
        ({"issued_at": float("nan")}, "issued_at: Input should be a finite number"),
        ({"issued_at": -1.0}, "issued_at: Input should be greater than or equal to 0"),
        # A job issued "at" version 2**40 parked a replica waiting for that version for ever.
        ({"issued_version": 2**40}, "issued_version: Input should be less than or equal to"),
        ({"prompt_index": -1}, "prompt_index: Input should be greater than or equal to 0"),
    ],
)
def test_counts_are_bounded_and_times_finite(changes: dict[str, object], message: str) -> None:
    """A planted job must not make a replica generate for ever, nor a NaN reach a mean."""
    with pytest.raises(SchemaError, match=re.escape(f"invalid prompt job: {message}")):
        decode_job(_job_meta(**changes))


def test_a_group_generated_by_a_version_past_any_run_does_not_decode() -> None:
    """policy_version 2**70 crashed the learner's `build_batch` (a tensor of int64): it is now a
    decoding error, which every reader dead-letters."""
    for planted in (
        make_group().model_copy(update={"policy_version": 2**70}),
        make_group(n=1).model_copy(
            update={
                "responses": [
                    make_group(n=1).responses[0].model_copy(update={"versions": (0, MAX_INDEX + 1)})
                ]
            }
        ),
    ):
        with pytest.raises(SchemaError, match="less than or equal to 2147483647"):
            decode_group(as_wire(encode_group(planted)))


def test_a_group_of_more_responses_than_any_sampler_asks_for_does_not_decode() -> None:
    small = make_group(n=1, length=0)
    g = RolloutGroup.model_construct(**{**dict(small), "responses": small.responses * 4097})
    with pytest.raises(SchemaError, match="responses: List should have at most 4096 items"):
        decode_group(as_wire(encode_group(g)))
