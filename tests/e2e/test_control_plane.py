"""The control plane on a real run: every endpoint answers with real figures, and the mutating
routes act on the learner: pause/resume, a checkpoint on request (kept by retention), and a
restore that rolls the learner back while replicas move on to a newer policy version."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from contracts.runtime import free_port
from services.run.redis_server import RedisServer
from tests.helpers import learner_step, wait_for

REPO = Path(__file__).resolve().parents[2]


def LOG(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Where the launcher's output goes (a pipe nobody reads could fill and block it)."""
    return (tmp_path / "dapo-run.log").open("a")


TOKEN = "e2e-token-0123456789abcdef0123456789"  # at least 32 characters
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def call(
    url: str, method: str = "GET", token: str | None = TOKEN, body: Any = None
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if "json" in resp.headers.get(
                "content-type", ""
            ) else text
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode() or "null")


def test_endpoints_and_operator_actions_on_a_real_run(tmp_path: Path, artifacts_dir: Path) -> None:
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        env = {**__import__("os").environ, "DAPO_API_TOKEN": TOKEN}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "run",
                "--config",
                "configs/tiny.yaml",
                "--output-dir",
                str(tmp_path / "run"),
                "--quiet",
                f"queue.redis_url={server.url}",
                f"api.port={port}",
                "learner.total_steps=40",
                "eval.every_steps=10",
                "checkpoint.every_steps=10",
                "checkpoint.keep_last=1",
            ],
            cwd=REPO,
            env=env,
            stdout=LOG(tmp_path),
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            step = lambda: learner_step(r)  # noqa: E731
            wait_for("step 5", lambda: step() >= 5)
            status = call(f"{api}/status")[1]
            (artifacts_dir / "status-sample.json").write_text(json.dumps(status, indent=1))
            assert status["ledger"]["balanced"] and status["policy_version"] >= 4
            assert {i["role"] for i in status["instances"]} >= {
                "learner",
                "rollout",
                "reward",
                "gatekeeper",
            }
            assert call(f"{api}/readyz")[0] == 200
            metrics = call(f"{api}/metrics")[1]
            assert "dapo_ledger_trained_total" in metrics and "dapo_actor_grad_norm" in metrics

            assert call(f"{api}/pause", "POST", token=None)[0] == 401
            assert call(f"{api}/pause", "POST")[0] == 202
            wait_for("paused", lambda: r.hget("dapo:learner:state", "state") == b"paused")
            paused_at = step()
            time.sleep(3)
            assert step() == paused_at  # no training while paused
            assert call(f"{api}/resume", "POST")[0] == 202
            wait_for("training again", lambda: step() > paused_at)

            assert call(f"{api}/checkpoints", "POST", body={"keep": True})[0] == 202
            kept = wait_for(
                "kept checkpoint", lambda: [c for c in call(f"{api}/checkpoints")[1] if c["keep"]]
            )
            kept_step = kept[0]["step"]
            store = tmp_path / "run" / "checkpoints"  # the API shows paths relative to it
            assert (store / kept[0]["hf_path"] / "model.safetensors").exists()
            wait_for("a periodic checkpoint after it", lambda: step() >= kept_step + 12)
            assert kept_step in [
                c["step"] for c in call(f"{api}/checkpoints")[1]
            ]  # keep survives keep_last=1

            version_before, step_before = int(r.get("dapo:policy_version")), step()
            assert call(f"{api}/checkpoints/{kept_step}/restore", "POST")[0] == 202
            wait_for("restored", lambda: r.hget("dapo:counters", "restores"))
            assert step() < step_before  # the learner went back to the checkpoint's step
            assert int(r.get("dapo:policy_version")) > version_before  # versions only go up
            proc.wait(timeout=600)
            output = (tmp_path / "dapo-run.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, output[-3000:]
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["ledger"]["balanced"] and summary["ledger"]["in_flight"] == 0
        assert summary["counters"].get("replica_version_regressions", 0) == 0
        assert set(summary["replica_final_versions"].values()) == {summary["policy_version"]}
