"""The dashboard in a real headless browser. Fed by a short real run (slow): the page loads, every
chart renders data points, and a screenshot is saved to test-artifacts/dashboard.png. Fed by
hostile strings in Redis (fast): they show as text, never as markup, under the API's
Content-Security-Policy, which the browser reports no violation of."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from contracts.bus import StreamBus, connect
from contracts.config import build_config
from contracts.keys import Keys, RunField
from contracts.runtime import free_port
from services.api.app import create_app
from services.run.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (scripts/install.sh installs it)"
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        str(CHROMIUM),
        *FLAGS,
        f"--user-data-dir={profile}",
        "--virtual-time-budget=10000",
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_cache")
def test_dashboard_renders_a_real_run(tmp_path: Path, artifacts_dir: Path) -> None:
    with RedisServer(tmp_path / "redis", appendonly=False) as server:
        run = subprocess.run(
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
                "learner.total_steps=12",
                "eval.every_steps=4",
                "checkpoint.every_steps=0",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        port = free_port()
        api = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "api",
                "--config",
                str(tmp_path / "run" / "config.yaml"),
                f"queue.redis_url={server.url}",
                "--port",
                str(port),
            ],
            cwd=REPO,
        )
        try:
            url = f"http://127.0.0.1:{port}/"
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(url + "healthz", timeout=1) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "the API did not start"
                time.sleep(0.3)
            dom = chromium(url, tmp_path / "profile-dom", "--dump-dom").stdout
            assert 'data-loaded="1"' in dom, dom[:2000]
            points = {}
            for tag in re.findall(r"<svg[^>]*>", dom):
                chart, count = (
                    re.search(r'data-chart="(\w+)"', tag),
                    re.search(r'data-points="(\d+)"', tag),
                )
                if chart:
                    points[chart.group(1)] = int(count.group(1)) if count else 0
            assert set(points) >= {
                "eval",
                "reward",
                "length",
                "entropy",
                "clip",
                "pass",
                "depth",
                "throughput",
                "lag",
            }
            assert all(n > 0 for n in points.values()), points
            assert points["reward"] >= 12 and points["eval"] >= 3
            shot = artifacts_dir / "dashboard.png"
            chromium(
                url, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1400,1500"
            )
            assert shot.exists() and shot.stat().st_size > 20_000
        finally:
            api.terminate()
            api.wait(10)


HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture()
def api_url(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """The API served in this process (uvicorn in a thread) over the test Redis."""
    cfg = build_config(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "queue": {"redis_url": redis_url, "namespace": "t"},
            "output_dir": str(tmp_path),
        }
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(cfg), host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}/"
    finally:
        server.should_exit = True
        thread.join(10)


def test_dashboard_shows_hostile_strings_as_text(
    redis_url: str, api_url: str, tmp_path: Path
) -> None:
    bus = StreamBus(connect(redis_url), Keys("t"), "test")
    bus.ensure_groups()
    for role in ("rollout", "learner"):
        beat = {
            "role": role,
            "id": f"{HOSTILE}-{role}",
            "host": HOSTILE,
            "pid": 1,
            "policy_version": 2,
            "state": HOSTILE,
            "at": time.time(),
        }
        bus.redis.set(bus.keys.heartbeat(role, "x"), json.dumps(beat), ex=600)
    bus.redis.hset(bus.keys.learner_state, mapping={"state": HOSTILE, "step": 2})
    bus.update_run_info({RunField.RUN_NAME: HOSTILE})
    bus.append_metrics({"step": 1, "time": time.time(), "critic/rewards/mean": 0.5})
    run = chromium(api_url, tmp_path / "profile", "--dump-dom", "--enable-logging=stderr", "--v=0")
    dom = run.stdout
    assert 'data-loaded="1"' in dom, (
        dom[:2000],
        run.stderr[-2000:],
    )  # the same-origin script ran under the CSP
    assert "<img" not in dom.lower() and "onerror" not in dom.replace(
        html.escape(HOSTILE, quote=False), ""
    )
    cells = re.findall(r"<td>([^<]*)</td>", dom)
    assert (
        html.escape(HOSTILE, quote=False) + "-rollout" in cells
        and html.escape(HOSTILE, quote=False) in cells
    )
    assert (
        html.escape(f"DAPO · {HOSTILE}", quote=False) in dom
        and html.escape(HOSTILE, quote=False) + "</b>" in dom
    )
    assert "Content Security Policy" not in run.stderr, run.stderr[
        -3000:
    ]  # nothing of the page's own was blocked
