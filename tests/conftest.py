"""Shared fixtures: a real redis-server for the session, flushed per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from services.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: object) -> Iterator[str]:
    import redis

    url: str = redis_server.url  # type: ignore[attr-defined]
    client = redis.Redis.from_url(url)
    client.flushall()
    yield url
    client.close()


@pytest.fixture()
def artifacts_dir() -> Path:
    path = REPO / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path
