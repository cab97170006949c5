"""Shared fixtures: a real redis-server for the session, flushed per test.

scripts/test.sh runs the suite on two pytest-xdist workers (`--dist loadgroup`). The end-to-end
tests (`slow`) each keep both cores busy and several judge pacing, so they all go to one worker,
one at a time, in the order pytest collects them; the other worker runs the quick tests and the
`io_bound` ones (image builds, package resolution, downloads), which mostly wait. Session
fixtures are per worker; what they build in the repository (runs/cache) is built under a lock.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("io_bound"):
            item.add_marker(pytest.mark.xdist_group("one-at-a-time"))


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Qwen2 model + locally trained tokenizer (no skill)."""
    from transformers import AutoModelForCausalLM

    from services.demo.synthetic import synth_rows
    from services.demo.tiny_base import tiny_qwen2_config, train_tokenizer

    out = tmp_path_factory.mktemp("tiny-model")
    rows = synth_rows(500, seed=0)
    tok = train_tokenizer([r["prompt"][0]["content"] + "Answer: 123" for r in rows], vocab_size=300)
    import torch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(len(tok)))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_cache() -> None:
    """The tiny preset's synthetic data and SFT-warmed base model under runs/cache, built once.

    On a fresh checkout this takes minutes (the first `dapo run` would do it too); building it
    here, before any test starts a run, keeps that one-time cost out of the runs' own timeouts.
    A subprocess keeps the build's torch thread settings out of the test process."""
    import subprocess
    import sys

    code = (
        "from contracts.config import load_config; from services.launcher import prepare; "
        "prepare(load_config('configs/tiny.yaml'))"
    )
    lock_path = REPO / "runs" / ".tiny-cache.lock"
    lock_path.parent.mkdir(exist_ok=True)
    with lock_path.open("w") as lock:  # the other worker may be building it right now
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=3600)
