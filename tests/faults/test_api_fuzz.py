"""Property-based fuzzing of the REST API against its own OpenAPI spec (schemathesis): no
generated request, with or without a valid token, produces a 5xx, and mutating routes refuse
requests without the token. And the other way round (hypothesis): whatever garbage Redis holds in
the values the status reads, /status, /readyz and /metrics answer without a 5xx, and the
Prometheus page parses with each series once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from contracts.bus import StreamBus, connect
from contracts.config import build_config
from contracts.keys import (
    LEDGER_ISSUED,
    LEDGER_OUTCOMES,
    Counter,
    Keys,
    RunField,
    restarts_counter,
)
from contracts.runtime import Heartbeat
from services.api.app import create_app
from tests.contracts.test_streams import issue

LOCAL = "http://127.0.0.1"  # the API answers loopback Host names only
TOKEN = "fuzz-token-0123456789abcdef0123456789"  # at least 32 characters
MUTATING = {"POST"}


@pytest.fixture()
def api_schema(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> schemathesis.schemas.BaseSchema:
    monkeypatch.setenv("DAPO_API_TOKEN", TOKEN)
    cfg = build_config(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "output_dir": str(tmp_path),
            "queue": {"redis_url": redis_url, "namespace": "dapo"},
            "api": {"allowed_hosts": ["testserver", "localhost"]},  # schemathesis's client
        }
    )
    bus = StreamBus(connect(redis_url), Keys("dapo"), "fuzz")
    bus.ensure_groups()
    issue(bus, 3)
    # A live learner, so /readyz answers 200 (its 503 without one is the designed answer).
    Heartbeat(
        bus, "learner", "learner-fuzz", ttl_s=600, status=lambda: {"state": "training"}
    ).beat()
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(cfg))


def operations(schema: schemathesis.schemas.BaseSchema) -> list[object]:
    return [result.ok() for result in schema.get_all_operations()]


def fuzz(schema: schemathesis.schemas.BaseSchema, check: object, max_examples: int) -> int:
    """Run `check(case)` on generated cases of every operation; returns how many ran."""
    ran = 0
    for op in operations(schema):

        @given(case=op.as_strategy())  # type: ignore[attr-defined]
        @settings(
            max_examples=max_examples,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def run(case: schemathesis.Case) -> None:
            nonlocal ran
            ran += 1
            check(case)  # type: ignore[operator]

        run()
    return ran


def test_no_server_errors_with_a_valid_token(api_schema: schemathesis.schemas.BaseSchema) -> None:
    def check(case: schemathesis.Case) -> None:
        response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}"
        )

    assert fuzz(api_schema, check, 40) > 100


def test_mutating_routes_refuse_missing_or_wrong_tokens(
    api_schema: schemathesis.schemas.BaseSchema,
) -> None:
    def check(case: schemathesis.Case) -> None:
        # The spec documents the Authorization header, so generated cases carry random values:
        # those must be refused (403); without the header, 401.
        generated = {k.lower(): v for k, v in (case.headers or {}).items()}
        if case.method.upper() in MUTATING and "authorization" in generated:
            assert case.call().status_code in (403, 422)
        case.headers = {
            k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"
        }
        anonymous = case.call()
        assert anonymous.status_code < 500
        if case.method.upper() in MUTATING:
            assert anonymous.status_code in (401, 422), anonymous.status_code
            wrong = case.call(headers={"Authorization": "Bearer nope"})
            assert wrong.status_code in (403, 422), wrong.status_code

    assert fuzz(api_schema, check, 15) > 50


# --- garbage in Redis ----------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
HEARTBEAT_FIELDS = (
    "role",
    "id",
    "at",
    "host",
    "pid",
    "policy_version",
    "state",
    "idle_fraction",
    "groups",
    "pass_rate",
)
ALMOST_A_HEARTBEAT = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["learner", "rollout"]),
        "id": st.text(max_size=8),
        "at": st.floats() | st.just(1e10),
    },
    optional={f: JSON for f in HEARTBEAT_FIELDS[3:]},
)
RAW = st.binary(max_size=16) | JSON.map(lambda v: json.dumps(v).encode())
HEARTBEATS = st.lists(RAW | ALMOST_A_HEARTBEAT.map(lambda v: json.dumps(v).encode()), max_size=4)


def hash_of(names: list[str]) -> st.SearchStrategy[dict[str, bytes]]:
    return st.dictionaries(st.sampled_from(names) | st.text(max_size=6), RAW, max_size=4)


HASHES = st.fixed_dictionaries(
    {
        "learner_state": hash_of(["state", "step", "policy_version", "at"]),
        "ledger": hash_of([LEDGER_ISSUED, *LEDGER_OUTCOMES]),
        "counters": hash_of([*(c.value for c in Counter), restarts_counter("rollout-0")]),
        "run_info": hash_of([f.value for f in RunField]),
        "control": hash_of(["pause", "checkpoint", "restore"]),
    }
)


def test_garbage_in_redis_never_gives_a_server_error(redis_url: str, tmp_path: Path) -> None:
    cfg = build_config(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "output_dir": str(tmp_path),
            "queue": {"redis_url": redis_url, "namespace": "garbage"},
        }
    )
    bus = StreamBus(connect(redis_url), Keys("garbage"), "fuzz")
    client = TestClient(create_app(cfg), raise_server_exceptions=False, base_url=LOCAL)
    ran = 0

    @given(heartbeats=HEARTBEATS, hashes=HASHES, records=st.lists(RAW, max_size=3), version=RAW)
    @settings(
        max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def run(
        heartbeats: list[bytes],
        hashes: dict[str, dict[str, bytes]],
        records: list[bytes],
        version: bytes,
    ) -> None:
        nonlocal ran
        ran += 1
        bus.clear_namespace()
        for i, raw in enumerate(heartbeats):
            bus.redis.set(bus.keys.heartbeat("rollout", f"r{i}"), raw, ex=60)
        for key, mapping in hashes.items():
            if mapping:
                bus.redis.hset(getattr(bus.keys, key), mapping=mapping)  # type: ignore[arg-type]
        for raw in records:
            bus.redis.xadd(bus.keys.metrics, {"m": raw})
        bus.redis.set(bus.keys.policy_version, version)
        for path in ("/status", "/metrics/history"):
            r = client.get(path)
            assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:300]}"
        ready = client.get("/readyz")
        assert ready.status_code == 200 or "learner heartbeat" in ready.json()["detail"], (
            ready.text[:300]
        )
        assert_one_series_each(client.get("/metrics").text)

    run()
    assert ran > 100


def assert_one_series_each(text: str) -> None:
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names
    series: list[tuple[str, Any]] = [
        (s.name, sorted(s.labels.items())) for f in families for s in f.samples
    ]
    assert len(series) == len({(n, tuple(labels)) for n, labels in series}), series
