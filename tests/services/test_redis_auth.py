"""Credentials for Redis: the embedded server requires its password, reads it from a 0600 file
(never a command line) that is gone once the server answers, and logs and config dumps show URLs
with the password masked."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
import redis

from contracts.config import load_config, redact_url
from services.run.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]


def test_the_embedded_server_requires_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    conf = tmp_path / "redis.conf"
    modes = []
    unlink = Path.unlink

    def seen_before_removal(path: Path, missing_ok: bool = False) -> None:
        if path == conf and path.exists():
            modes.append((stat.S_IMODE(path.stat().st_mode), "pa/ss:word@1" in path.read_text()))
        unlink(path, missing_ok=missing_ok)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "unlink", seen_before_removal)
        server = RedisServer(tmp_path, appendonly=False, password="pa/ss:word@1").start()
    with server:
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        assert modes[-1] == (0o600, True)  # it was there, for the server only, ...
        assert not conf.exists()  # ... and is gone while the run goes on
        assert server.proc is not None and "pa/ss:word@1" not in " ".join(
            map(str, server.proc.args)
        )  # type: ignore[arg-type]
    assert "pa/ss" not in caplog.text and "***" in caplog.text


def test_urls_are_masked_in_dumps() -> None:
    assert redact_url("redis://:hunter2@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("redis://dapo:hunter2@redis:6379/0") == "redis://dapo:***@redis:6379/0"
    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
    assert (
        redact_url("redis://redis:6379/0?password=hunter2&db=1&socket_timeout=5")
        == "redis://redis:6379/0?password=***&db=1&socket_timeout=5"
    )
    assert redact_url("rediss://u:p%40ss@h:6380/0?Token=x") == "rediss://u:***@h:6380/0?Token=***"
    assert redact_url("redis://:a:b@[::1]:6379") == "redis://:***@[::1]:6379"
    cfg = load_config(
        REPO / "configs" / "tiny.yaml", ["queue.redis_url=redis://dapo:hunter2@redis:6379/0"]
    )
    assert (
        cfg.redis_url == "redis://dapo:hunter2@redis:6379/0"
    )  # the services still connect with it
    dumped = cfg.model_dump(mode="json")  # what config.yaml, trainer.json and the trackers get
    assert dumped["queue"]["redis_url"] == "redis://dapo:***@redis:6379/0"
