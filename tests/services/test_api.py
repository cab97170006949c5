"""The REST control plane against a real Redis: status figures, the Prometheus page, auth rules,
4xx on bad input, and a dashboard that builds no HTML from data."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from contracts.bus import StreamBus, connect
from contracts.checkpoint_store import MARKER
from contracts.config import build_config
from contracts.keys import Counter, Keys, restarts_counter
from contracts.runtime import Heartbeat
from services.api.app import create_app
from tests.contracts.test_streams import issue

LOCAL = "http://127.0.0.1"  # the API answers loopback Host names only
TOKEN = "s3cret-0123456789abcdef0123456789"  # at least 32 characters


@pytest.fixture()
def setup(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[TestClient, StreamBus, Path]:
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
    return TestClient(create_app(cfg), base_url=LOCAL), bus, cfg.checkpoint_dir


def commit_checkpoint(store: Path, step: int, *, committed: bool = True) -> None:
    d = store / f"step_{step}"
    (d / "hf").mkdir(parents=True)
    (d / "trainer.json").write_text(
        json.dumps({"step": step, "policy_version": step, "data_cursor": 10 * step})
    )
    if committed:
        (d / MARKER).write_text("x")


def test_health_and_readiness(setup: tuple[TestClient, StreamBus, Path]) -> None:
    client, bus, _ = setup
    assert client.get("/healthz").json() == {"ok": True}
    r = client.get("/readyz")
    assert r.status_code == 503 and "learner heartbeat" in r.json()["detail"]
    hb = Heartbeat(
        bus,
        "learner",
        "learner-1",
        ttl_s=5,
        status=lambda: {"policy_version": 3, "state": "training"},
    )
    hb.beat()
    bus.redis.hset(bus.keys.learner_state, mapping={"state": "training", "step": 3})
    assert client.get("/readyz").json()["ready"] is True


def test_status_and_metrics_report_real_figures(setup: tuple[TestClient, StreamBus, Path]) -> None:
    client, bus, _ = setup
    issue(bus, 3)
    bus.redis.set(bus.keys.policy_version, 7)
    bus.redis.xadd(
        bus.keys.metrics,
        {
            "m": json.dumps(
                {
                    "step": 1,
                    "time": time.time() - 2,
                    "critic/rewards/mean": -0.5,
                    "rollout/tokens": 100,
                    "rollout/groups": 4,
                }
            )
        },
    )
    bus.redis.xadd(
        bus.keys.metrics,
        {
            "m": json.dumps(
                {
                    "step": 2,
                    "time": time.time(),
                    "critic/rewards/mean": 0.25,
                    "rollout/tokens": 300,
                    "rollout/groups": 4,
                }
            )
        },
    )
    Heartbeat(bus, "rollout", "r-1", ttl_s=5, status=lambda: {"policy_version": 7}).beat()
    status = client.get("/status").json()
    assert status["policy_version"] == 7
    assert status["ledger"] == {
        "issued": 3,
        "trained": 0,
        "filtered": 0,
        "stale": 0,
        "dead": 0,
        "eval_issued": 0,
        "evaluated": 0,
        "eval_dead": 0,
        "in_flight": 3,
        "balanced": True,
        "damaged": False,
    }
    assert status["stream_depths"]["rollout"] == 3
    assert status["last_metrics"]["critic/rewards/mean"] == 0.25
    assert status["throughput"]["tokens_per_s"] == pytest.approx(150, rel=0.05)
    [inst] = status["instances"]
    assert (inst["role"], inst["policy_version"]) == ("rollout", 7) and inst["heartbeat_age_s"] < 5
    text = client.get("/metrics").text
    assert "dapo_ledger_issued_total 3.0" in text
    assert 'dapo_stream_depth{stage="rollout"} 3.0' in text
    assert "dapo_critic_rewards_mean 0.25" in text
    assert len(client.get("/metrics/history").json()) == 2


def test_status_and_metrics_show_what_generation_paid_for(
    setup: tuple[TestClient, StreamBus, Path],
) -> None:
    client, bus, _ = setup
    assert client.get("/status").json()["generation"] == {
        "generated_per_trained": None,  # nothing trained yet
        "prompts_skipped": 0,
    }
    bus.redis.hset(
        bus.keys.ledger, mapping={"issued": 30, "trained": 16, "filtered": 10, "stale": 2}
    )
    bus.incr(Counter.PROMPTS_SKIPPED, 12)
    assert client.get("/status").json()["generation"] == {
        "generated_per_trained": 1.75,  # (16 + 10 + 2) / 16
        "prompts_skipped": 12,
    }
    text = client.get("/metrics").text
    assert "dapo_generated_per_trained 1.75" in text
    assert "dapo_prompts_skipped_total 12.0" in text


def test_checkpoint_listing_hides_uncommitted(setup: tuple[TestClient, StreamBus, Path]) -> None:
    client, _, store = setup
    commit_checkpoint(store, 5)
    commit_checkpoint(store, 10)
    commit_checkpoint(store, 15, committed=False)  # half-written
    assert [c["step"] for c in client.get("/checkpoints").json()] == [5, 10]
    ten = client.get("/checkpoints/10").json()
    assert ten["data_cursor"] == 100
    # Paths relative to the store: the machine's layout is not shown to unauthenticated readers.
    assert (ten["path"], ten["hf_path"]) == ("step_10", "step_10/hf")
    assert str(store) not in client.get("/checkpoints").text
    r = client.get("/checkpoints/15")
    assert r.status_code == 404 and "step 15" in r.json()["detail"]
    assert client.get("/checkpoints/abc").status_code == 422


def test_mutating_routes_need_the_token(
    setup: tuple[TestClient, StreamBus, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, bus, store = setup
    commit_checkpoint(store, 5)
    assert client.post("/pause").status_code == 401
    assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 403
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/pause", headers=auth).status_code == 202
    assert client.get("/status").json()["paused"] is True
    assert client.post("/resume", headers=auth).status_code == 202
    assert client.get("/status").json()["paused"] is False
    r = client.post("/checkpoints", headers=auth, json={"keep": True})
    assert r.status_code == 202
    assert json.loads(bus.redis.hget(bus.keys.control, "checkpoint"))["keep"] is True
    bad = client.post("/checkpoints", headers=auth, json={"kep": True})
    assert bad.status_code == 422 and "kep" in bad.text
    assert client.post("/checkpoints/99/restore", headers=auth).status_code == 404
    assert client.post("/checkpoints/5/restore", headers=auth).status_code == 202
    assert json.loads(bus.redis.hget(bus.keys.control, "restore"))["step"] == 5
    monkeypatch.delenv("DAPO_API_TOKEN")
    r = client.post("/pause", headers=auth)
    assert r.status_code == 403 and "disabled" in r.json()["detail"]


def test_each_accepted_mutation_is_logged_with_who_and_what(
    setup: tuple[TestClient, StreamBus, Path], caplog: pytest.LogCaptureFixture
) -> None:
    client, _, store = setup
    commit_checkpoint(store, 5)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with caplog.at_level(logging.INFO, logger="dapo.audit"):
        assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.post("/pause", headers=auth).status_code == 202
        assert client.post("/checkpoints/5/restore", headers=auth).status_code == 202
    lines = [r.getMessage() for r in caplog.records if r.name == "dapo.audit"]
    fingerprint = hashlib.sha256(TOKEN.encode()).hexdigest()[:12]
    assert lines == [
        f"mutation by testclient:50000 (token {fingerprint}): pause requested",
        f"mutation by testclient:50000 (token {fingerprint}): restore of step 5 requested",
    ]
    assert not any(TOKEN in line for line in lines)


def test_dashboard_is_self_contained_and_builds_no_html_from_data(
    setup: tuple[TestClient, StreamBus, Path],
) -> None:
    client, _, _ = setup
    page, script, style = client.get("/"), client.get("/dashboard.js"), client.get("/dashboard.css")
    for r in (page, script, style):
        assert r.status_code == 200
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
    csp = dict(d.strip().split(" ", 1) for d in page.headers["content-security-policy"].split(";"))
    assert (
        csp["script-src"] == "'self'"
        and csp["style-src"] == "'self'"
        and csp["default-src"] == "'none'"
    )
    assert script.headers["content-type"].startswith("text/javascript")
    assert style.headers["content-type"].startswith("text/css")
    # The CSP runs no inline script or style, so the page holds none:
    # only the two same-origin files.
    html = page.text
    assert re.findall(r"<script[^>]*>", html) == ['<script src="dashboard.js" defer>']
    assert (
        re.search(r"<script[^>]*>\s*[^<\s]", html) is None
        and "<style" not in html
        and " style=" not in html
    )
    assert re.search(r"\son[a-z]+=", html) is None  # no inline event handlers
    # The script builds the DOM with createElement/textContent only.
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "Function(",
    ):
        assert sink not in script.text, sink
    assert "textContent" in script.text and "createElementNS" in script.text
    external = (html + script.text + style.text).replace("http://www.w3.org/2000/svg", "")
    assert "http://" not in external and "https://" not in external  # no CDN


def test_metrics_page_parses_with_restarts_and_hostile_ids(
    setup: tuple[TestClient, StreamBus, Path],
) -> None:
    client, bus, _ = setup
    hostile = 'r"0\\x\n} evil{a="1'
    issue(bus, 2)
    Heartbeat(bus, "rollout", hostile, ttl_s=30, status=lambda: {"policy_version": 4}).beat()
    Heartbeat(bus, "rollout", "rollout-1", ttl_s=30, status=lambda: {"policy_version": 5}).beat()
    bus.incr(restarts_counter("rollout-0"))  # what the launcher writes when it restarts a service
    bus.incr(restarts_counter("rollout-0"))
    bus.incr(restarts_counter(hostile))
    bus.incr(Counter.DEAD_LETTERS)  # a counter sharing its name with a status figure
    # Learner metrics that map onto names the status itself emits must not give a second series.
    bus.append_metrics(
        {
            "step": 3,
            "time": time.time(),
            "ledger/in_flight": 9,
            "ledger/issued": 9,
            "critic/rewards/mean": 0.5,
        }
    )
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith(
        "text/plain; version=0.0.4"
    )
    families = list(text_string_to_metric_families(r.text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names
    series = [(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples]
    assert len(series) == len(set(series)), series
    assert all(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) for name, _ in series)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples
    }
    assert values[("dapo_restarts_total", (("service", "rollout-0"),))] == 2
    assert values[("dapo_restarts_total", (("service", hostile),))] == 1
    assert values[("dapo_instance_policy_version", (("id", hostile), ("role", "rollout")))] == 4
    assert values[("dapo_instance_policy_version", (("id", "rollout-1"), ("role", "rollout")))] == 5
    assert (
        values[("dapo_ledger_in_flight", ())] == 2
    )  # the live ledger, not the learner's last record
    assert values[("dapo_ledger_issued_total", ())] == 2
    assert (
        values[("dapo_dead_letters_total", ())] == 1
        and values[("dapo_dead_letter_stream_entries", ())] == 0
    )
    assert values[("dapo_critic_rewards_mean", ())] == 0.5
    assert ("dapo_ledger_issued", ()) not in values


def test_a_token_too_short_to_keep_the_routes_closed_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before any Redis connection: `create_app` and `dapo api` (exit 2, the config-error
    status) name the variable and the minimum; an unset token (routes disabled) is allowed."""
    import subprocess
    import sys

    from contracts.config import ConfigError

    cfg = build_config({"model": {"path": "m"}, "data": {"train_path": "t"}})
    monkeypatch.setenv("DAPO_API_TOKEN", "hunter2")
    with pytest.raises(ConfigError, match=r"DAPO_API_TOKEN is 7 characters.*at least 32"):
        create_app(cfg)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "api", "--config", "configs/tiny.yaml"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "DAPO_REDIS_URL": "redis://127.0.0.1:1/0"},
    )
    assert proc.returncode == 2 and "at least 32" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("bind", "allowed", "host", "code"),
    [
        ("127.0.0.1", None, "127.0.0.1:8000", 200),
        ("127.0.0.1", None, "localhost", 200),
        ("127.0.0.1", None, "[::1]:8000", 200),
        ("127.0.0.1", None, "attacker.example:8000", 400),  # a rebound name
        ("0.0.0.0", None, "dapo-api.dapo.svc", 200),  # beyond loopback: any name by default
        ("0.0.0.0", ["dapo-api"], "dapo-api:8000", 200),
        ("0.0.0.0", ["dapo-api"], "evil", 400),
    ],
)
def test_host_header_names_outside_the_allowed_ones_get_400(
    bind: str, allowed: list[str] | None, host: str, code: int
) -> None:
    """DNS rebinding: a page whose name resolves to 127.0.0.1 would reach a loopback API as
    same-origin; the Host header it must send gives it away. Answered before Redis is touched."""
    api: dict[str, object] = {"host": bind} | ({"allowed_hosts": allowed} if allowed else {})
    cfg = build_config(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "queue": {"redis_url": "redis://127.0.0.1:1/0"},
            "api": api,
        }
    )
    client = TestClient(create_app(cfg), base_url="http://127.0.0.1")
    response = client.get("/healthz", headers={"host": host})
    assert response.status_code == code, response.text
    if code == 400:
        assert "is not served here" in response.text


def test_a_request_with_two_host_headers_gets_400() -> None:
    """A proxy that checks the first Host header and an app that reads the last would disagree
    about where a request goes: two are refused, whatever they say."""
    from starlette.types import Message, Scope

    cfg = build_config(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "queue": {"redis_url": "redis://127.0.0.1:1/0"},
        }
    )
    app = create_app(cfg)
    scope: Scope = {
        "type": "http",
        "method": "GET",
        "path": "/healthz",
        "raw_path": b"/healthz",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), (b"host", b"evil.example")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 5555),
        "root_path": "",
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    import asyncio

    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 400
    assert b"more than one Host header" in b"".join(m.get("body", b"") for m in sent[1:])
