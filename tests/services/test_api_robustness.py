"""The control plane against hostile input: garbage written straight into Redis never makes
/status, /readyz or /metrics answer 500 (the value is left out, and counted where the API is the
one skipping it), and request bodies are refused before they are read (no token: 401; too big:
413), driven at the ASGI level so the test sees how many body bytes the app pulled."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from contracts.bus import StreamBus, connect
from contracts.config import build_config
from contracts.keys import Counter, Keys, RunField
from contracts.runtime import Heartbeat
from services.api.app import MAX_BODY_BYTES, create_app
from services.api.status import format_status, run_status
from tests.contracts.test_streams import issue

LOCAL = "http://127.0.0.1"  # the API answers loopback Host names only
TOKEN = "s3cret-0123456789abcdef0123456789"  # at least 32 characters
MiB = 1 << 20


@pytest.fixture()
def api(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[FastAPI, StreamBus]:
    monkeypatch.setenv("DAPO_API_TOKEN", TOKEN)
    cfg = build_config(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "queue": {"redis_url": redis_url, "namespace": "t"},
            "output_dir": str(tmp_path),
        }
    )
    bus = StreamBus(connect(redis_url), Keys("t"), "test")
    bus.ensure_groups()
    issue(bus, 2)
    Heartbeat(
        bus,
        "learner",
        "learner-0",
        ttl_s=60,
        status=lambda: {"policy_version": 3, "state": "training"},
    ).beat()
    Heartbeat(bus, "rollout", "rollout-0", ttl_s=60, status=lambda: {"policy_version": 3}).beat()
    bus.redis.hset(bus.keys.learner_state, mapping={"state": "training", "step": 3})
    return create_app(cfg), bus


def heartbeat(bus: StreamBus, inst: str, raw: str | bytes, role: str = "rollout") -> None:
    bus.redis.set(bus.keys.heartbeat(role, inst), raw, ex=60)


def hb_json(role: str, inst: str, **fields: object) -> str:
    return json.dumps({"role": role, "id": inst, "host": "h", "pid": 1, "at": 2e9, **fields})


# name -> (write the garbage, the `skipped_values` source the API counts it under when it reaches
# the API, or None). The bus layer may drop a value first, counting it in its own counter instead.
BUS_SKIPS = "bad_redis_values"
GARBAGE: dict[str, tuple[Callable[[StreamBus], object], str | None]] = {
    "heartbeat not JSON": (lambda b: heartbeat(b, "x", b"{not json \xff"), None),
    "heartbeat a JSON list": (lambda b: heartbeat(b, "x", "[1, 2]"), None),
    "heartbeat at not a number": (
        lambda b: heartbeat(b, "x", hb_json("rollout", "x", at="soon")),
        None,
    ),
    "heartbeat at NaN": (
        lambda b: heartbeat(b, "x", '{"role": "rollout", "id": "x", "at": NaN}'),
        "heartbeats",
    ),
    "heartbeat at infinite": (
        lambda b: heartbeat(b, "x", '{"role": "rollout", "id": "x", "at": 1e999}'),
        "heartbeats",
    ),
    "heartbeat id not a string": (
        lambda b: heartbeat(b, "x", json.dumps({"role": "rollout", "id": {"a": [1]}, "at": 2e9})),
        "heartbeats",
    ),
    "heartbeat policy_version not an integer": (
        lambda b: heartbeat(b, "x", hb_json("rollout", "x", policy_version="abc")),
        "heartbeat_fields",
    ),
    "heartbeat groups a list, idle_fraction text": (
        lambda b: heartbeat(b, "x", hb_json("rollout", "x", groups=[1], idle_fraction="half")),
        "heartbeat_fields",
    ),
    "two heartbeats claiming one id": (
        lambda b: heartbeat(b, "x", hb_json("rollout", "rollout-0")),
        "heartbeats",
    ),
    "policy version not an integer": (lambda b: b.redis.set(b.keys.policy_version, "seven"), None),
    "policy version key of another type": (
        lambda b: b.redis.hset(b.keys.policy_version, "a", "b"),
        "policy_version",
    ),
    "control request not JSON": (
        lambda b: b.redis.hset(b.keys.control, "pause", b"\xffgarbage"),
        None,
    ),
    "control key of another type": (lambda b: b.redis.set(b.keys.control, "garbage"), "control"),
    "learner state garbage": (
        lambda b: b.redis.hset(
            b.keys.learner_state, mapping={"step": "many", "at": "x", "policy_version": "v"}
        ),
        None,
    ),
    "learner state key of another type": (
        lambda b: b.redis.set(b.keys.learner_state, "garbage"),
        "learner_state",
    ),
    "ledger count not an integer": (
        lambda b: b.redis.hset(b.keys.ledger, "issued", "lots"),
        "ledger",
    ),
    "counter not an integer": (
        lambda b: b.redis.hset(b.keys.counters, Counter.GATEKEEPER_KEPT, "x"),
        "counters",
    ),
    "metric records without a time": (
        lambda b: [b.redis.xadd(b.keys.metrics, {"m": '{"step": 1}'}) for _ in range(2)],
        None,
    ),
    "metric records with a text time": (
        lambda b: [
            b.redis.xadd(b.keys.metrics, {"m": '{"step": 1, "time": "x", "rollout/tokens": "y"}'})
            for _ in range(2)
        ],
        None,
    ),
    "run info garbage": (
        lambda b: b.redis.hset(
            b.keys.run_info,
            mapping={RunField.BASE_EVAL_ACC: "nan", RunField.EVAL_HISTORY: "[[1, NaN]]"},
        ),
        "eval_history",
    ),
    "dead-letter stream key of another type": (
        lambda b: b.redis.set(b.keys.dead, "garbage"),
        "dead_letters",
    ),
}


@pytest.mark.parametrize("case", list(GARBAGE))
def test_garbage_in_redis_is_skipped_not_a_500(api: tuple[FastAPI, StreamBus], case: str) -> None:
    app, bus = api
    write, source = GARBAGE[case]
    write(bus)
    client = TestClient(app, raise_server_exceptions=False, base_url=LOCAL)
    status = client.get("/status")
    assert status.status_code == 200, status.text
    body = status.json()
    assert body["learner_state"] != "down"  # the good learner heartbeat still counts
    assert ("rollout", "rollout-0") in {(i["role"], i["id"]) for i in body["instances"]}
    for row in body["instances"]:  # what does reach the status is well-formed
        assert (
            isinstance(row["role"], str)
            and isinstance(row["id"], str)
            and math.isfinite(row["heartbeat_age_s"])
        )
        assert row["policy_version"] is None or type(row["policy_version"]) is int
    if source is not None:
        counted = body["skipped_values"].get(source, 0) + body["counters"].get(BUS_SKIPS, 0)
        assert counted >= 1, (body["skipped_values"], body["counters"])
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True, ready.text
    metrics = client.get("/metrics")
    assert metrics.status_code == 200, metrics.text
    families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    if source is not None and body["skipped_values"]:
        assert {s.labels["source"] for s in families["dapo_status_skipped_values"].samples} == set(
            body["skipped_values"]
        )
    assert client.get("/metrics/history").status_code == 200
    assert "rollout-0" in format_status(run_status(bus, heartbeat_ttl_s=60))


def test_garbage_values_read_as_none_not_as_made_up_figures(api: tuple[FastAPI, StreamBus]) -> None:
    app, bus = api
    bus.redis.hset(bus.keys.ledger, "issued", "lots")
    heartbeat(bus, "x", hb_json("rollout", "x", host=5, state=7, groups=[1], idle_fraction=0.25))
    client = TestClient(app, base_url=LOCAL)
    status = client.get("/status").json()
    assert status["ledger"] is None  # not a zeroed, "balanced" ledger
    [row] = [i for i in status["instances"] if i["id"] == "x"]
    assert (
        row["host"] is None
        and "state" not in row
        and "groups" not in row
        and row["idle_fraction"] == 0.25
    )
    assert (
        status["skipped_values"] == {"ledger": 1, "heartbeat_fields": 3}
        and status["gatekeeper_pass_rate"] is None
    )
    names = {f.name for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert not {"dapo_ledger_issued", "dapo_ledger_in_flight", "dapo_ledger_balanced"} & names


def test_a_malformed_learner_heartbeat_means_not_ready(api: tuple[FastAPI, StreamBus]) -> None:
    app, bus = api
    heartbeat(bus, "learner-0", hb_json("learner", "learner-0", at="soon"), role="learner")
    client = TestClient(app, base_url=LOCAL)
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "learner heartbeat" in ready.json()["detail"]
    assert client.get("/status").json()["learner_state"] == "down"


def test_a_heartbeat_of_the_release_before_the_role_rename_still_counts(
    api: tuple[FastAPI, StreamBus],
) -> None:
    """A process of the previous release names its role `kind`: during a rolling upgrade its
    learner must not look down to a new API (503 from /readyz)."""
    app, bus = api
    old = {"kind": "learner", "id": "learner-0", "host": "h", "pid": 1, "at": time.time()}
    heartbeat(bus, "learner-0", json.dumps(old), role="learner")
    client = TestClient(app, base_url=LOCAL)
    assert client.get("/readyz").status_code == 200
    rows = client.get("/status").json()["instances"]
    assert ("learner", "learner-0") in {(i["role"], i["id"]) for i in rows}


def test_status_table_escapes_control_characters(api: tuple[FastAPI, StreamBus]) -> None:
    _, bus = api
    Heartbeat(bus, "rollout", "evil\x1b[2J\nid", ttl_s=60).beat()
    table = format_status(run_status(bus, heartbeat_ttl_s=60))
    assert "\x1b" not in table and "evil\\x1b[2J\\nid" in table


# --- request bodies, at the ASGI level ------------------------------------------------------
def call(
    app: FastAPI, path: str, chunks: Iterator[bytes], headers: dict[str, str]
) -> tuple[int, int, dict[str, str], bytes]:
    """POST `path` with the body sent as `chunks`; returns (status, body bytes the app pulled,
    response headers, response body)."""
    pulled = 0
    pending = next(chunks, None)
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        nonlocal pending, pulled
        if pending is None:
            return {"type": "http.disconnect"}
        chunk, pending = pending, next(chunks, None)
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": pending is not None}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "server": ("test", 80),
        "client": ("test", 1),
        "headers": [(b"host", b"127.0.0.1")]
        + [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    start = next(m for m in sent if m["type"] == "http.response.start")
    response_headers = {k.decode(): v.decode() for k, v in start["headers"]}  # type: ignore[attr-defined]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")  # type: ignore[misc]
    return int(start["status"]), pulled, response_headers, body  # type: ignore[call-overload]


def body_of(total: int, chunk: int = MiB) -> Iterator[bytes]:
    for start in range(0, total, chunk):
        yield b" " * min(chunk, total - start)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_huge_body_without_a_token_is_refused_before_it_is_read(
    api: tuple[FastAPI, StreamBus], declared: bool
) -> None:
    app, bus = api
    headers = {
        "content-type": "application/json",
        **({"content-length": str(50 * MiB)} if declared else {}),
    }
    status, pulled, response_headers, body = call(app, "/checkpoints", body_of(50 * MiB), headers)
    assert (status, pulled) == (401, 0) and b"missing bearer token" in body
    assert (
        response_headers["connection"] == "close"
        and "frame-ancestors 'none'" in response_headers["content-security-policy"]
    )
    status, pulled, _, _ = call(
        app, "/checkpoints", body_of(50 * MiB), {**headers, "authorization": "Bearer wrong"}
    )
    assert (status, pulled) == (403, 0)
    assert bus.redis.hlen(bus.keys.control) == 0


def test_a_body_over_the_limit_with_a_token_gets_413(api: tuple[FastAPI, StreamBus]) -> None:
    app, bus = api
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    status, pulled, _, body = call(
        app, "/checkpoints", body_of(MiB), {**auth, "content-length": str(MiB)}
    )
    assert (status, pulled) == (413, 0) and str(MAX_BODY_BYTES).encode() in body
    chunk = 16 * 1024
    status, pulled, _, _ = call(
        app, "/checkpoints", body_of(MiB, chunk), auth
    )  # chunked: counted while read
    assert status == 413 and MAX_BODY_BYTES < pulled <= MAX_BODY_BYTES + chunk
    assert bus.redis.hlen(bus.keys.control) == 0
    ok = b'{"keep": true}'
    status, pulled, _, body = call(app, "/checkpoints", iter([ok[:5], ok[5:]]), auth)
    assert (status, pulled) == (202, len(ok)), body
    assert json.loads(bus.redis.hget(bus.keys.control, "checkpoint"))["keep"] is True
    client = TestClient(app, base_url=LOCAL)
    assert (
        client.post(
            "/checkpoints", headers=auth, content=b"{" + b" " * MAX_BODY_BYTES + b"}"
        ).status_code
        == 413
    )
    assert client.post("/checkpoints", headers=auth, json={"keep": False}).status_code == 202
