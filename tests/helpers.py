"""Helpers shared by the tests that drive real runs."""

from __future__ import annotations

import time
from typing import Any

import redis


def wait_for(what: str, check: Any, timeout_s: float = 300, every_s: float = 0.2) -> Any:
    """Poll `check()` until it returns something truthy; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f}s")


def learner_step(r: redis.Redis, namespace: str = "dapo") -> int:
    """The step the learner is on (as it publishes it in its state hash)."""
    return int(r.hget(f"{namespace}:learner:state", "step") or 0)
