"""The dashboard in a real headless browser, fed by a short real run: the page loads, every
chart renders data points, and a screenshot is saved to test-artifacts/dashboard.png."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.contracts.runtime import free_port
from services.shell.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache"), pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/install.sh installs it)")]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_dashboard_renders_a_real_run(tmp_path: Path, artifacts_dir: Path) -> None:
    with RedisServer(tmp_path / "redis", appendonly=False) as server:
        run = subprocess.run(
            [sys.executable, "-m", "services.shell.cli", "run", "--config", "configs/tiny.yaml", "--output-dir", str(tmp_path / "run"),
             "--quiet", f"queue.redis_url={server.url}", "learner.total_steps=12", "eval.every_steps=4", "checkpoint.every_steps=0"],
            cwd=REPO, capture_output=True, text=True, timeout=900,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        port = free_port()
        api = subprocess.Popen(
            [sys.executable, "-m", "services.shell.cli", "api", "--config", str(tmp_path / "run" / "config.yaml"), f"queue.redis_url={server.url}",
             "--port", str(port)], cwd=REPO,
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
                chart, count = re.search(r'data-chart="(\w+)"', tag), re.search(r'data-points="(\d+)"', tag)
                if chart:
                    points[chart.group(1)] = int(count.group(1)) if count else 0
            assert set(points) >= {"eval", "reward", "length", "entropy", "clip", "pass", "depth", "throughput", "lag"}
            assert all(n > 0 for n in points.values()), points
            assert points["reward"] >= 12 and points["eval"] >= 3
            shot = artifacts_dir / "dashboard.png"
            chromium(url, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1400,1500")
            assert shot.exists() and shot.stat().st_size > 20_000
        finally:
            api.terminate()
            api.wait(10)
