"""Property-based fuzzing of the REST API against its own OpenAPI spec (schemathesis): no
generated request, with or without a valid token, produces a 5xx, and mutating routes refuse
requests without the token."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from services.contracts.bus import StreamBus, connect
from services.contracts.config import build_config
from services.contracts.keys import Keys
from services.contracts.runtime import Heartbeat
from services.shell.api import create_app
from tests.services.test_streams import issue

TOKEN = "fuzz-token"
MUTATING = {"POST"}


@pytest.fixture()
def api_schema(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> schemathesis.schemas.BaseSchema:
    monkeypatch.setenv("DAPO_API_TOKEN", TOKEN)
    cfg = build_config({"model": {"path": "m"}, "data": {"train_path": "t"}, "output_dir": str(tmp_path),
                        "queue": {"redis_url": redis_url, "namespace": "dapo"}})
    bus = StreamBus(connect(redis_url), Keys("dapo"), "fuzz")
    bus.ensure_groups()
    issue(bus, 3)
    # A live learner, so /readyz answers 200 (its 503 without one is the designed answer).
    Heartbeat(bus, "learner", "learner-fuzz", ttl_s=600, status=lambda: {"state": "training"}).beat()
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(cfg))


def operations(schema: schemathesis.schemas.BaseSchema) -> list[object]:
    return [result.ok() for result in schema.get_all_operations()]


def fuzz(schema: schemathesis.schemas.BaseSchema, check: object, max_examples: int) -> int:
    """Run `check(case)` on generated cases of every operation; returns how many ran."""
    ran = 0
    for op in operations(schema):

        @given(case=op.as_strategy())  # type: ignore[attr-defined]
        @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case: schemathesis.Case) -> None:
            nonlocal ran
            ran += 1
            check(case)  # type: ignore[operator]

        run()
    return ran


def test_no_server_errors_with_a_valid_token(api_schema: schemathesis.schemas.BaseSchema) -> None:
    def check(case: schemathesis.Case) -> None:
        response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}"

    assert fuzz(api_schema, check, 40) > 100


def test_mutating_routes_refuse_missing_or_wrong_tokens(api_schema: schemathesis.schemas.BaseSchema) -> None:
    def check(case: schemathesis.Case) -> None:
        # The spec documents the Authorization header, so generated cases carry random values:
        # those must be refused (403); without the header, 401.
        generated = {k.lower(): v for k, v in (case.headers or {}).items()}
        if case.method.upper() in MUTATING and "authorization" in generated:
            assert case.call().status_code in (403, 422)
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        anonymous = case.call()
        assert anonymous.status_code < 500
        if case.method.upper() in MUTATING:
            assert anonymous.status_code in (401, 422), anonymous.status_code
            wrong = case.call(headers={"Authorization": "Bearer nope"})
            assert wrong.status_code in (403, 422), wrong.status_code

    assert fuzz(api_schema, check, 15) > 50
