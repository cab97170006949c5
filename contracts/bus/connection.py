"""Connecting to Redis: a client that retries when the server goes away and waits out a full
Redis (maxmemory) instead of failing, and the checks of the server's memory policy."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from contracts.keys import Counter

log = logging.getLogger(__name__)


OOM_PAUSE_COUNTER = Counter.REDIS_OOM_PAUSES.value


def is_oom(exc: redis.ResponseError) -> bool:
    """Redis refused a write at maxmemory (Redis 7 says OOM; 6.2 wraps it inside a script error)."""
    return isinstance(exc, redis.OutOfMemoryError) or "OOM command not allowed" in str(exc)


class PausingRedis(redis.Redis):
    """A client that waits out Redis at `maxmemory` instead of failing the caller.

    A refused command (OOM) is retried with back-off (0.5 s doubling to 5 s) until Redis accepts
    it; the first refusal logs a clear error, and the pause is counted under
    `OOM_PAUSE_COUNTER` in `counters_key` once Redis accepts writes again. If `stop` is set
    while paused the error is raised, so a process asked to exit is not held by a full Redis.
    """

    stop: threading.Event | None = None
    counters_key: str | None = None

    def execute_command(self, *args: Any, **options: Any) -> Any:
        paused_at: float | None = None
        delay = 0.5
        while True:
            try:
                result = super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
            except redis.ResponseError as exc:
                if not is_oom(exc):
                    raise
                if self.stop is not None and self.stop.is_set():
                    raise
                if paused_at is None:
                    paused_at = time.monotonic()
                    log.error(
                        "Redis is at maxmemory and refused %s: pausing until it accepts writes "
                        "again (raise the server's maxmemory, or lower algorithm.max_staleness / "
                        "oversampling so less work is queued); nothing has been dropped",
                        args[0],
                    )
                if self.stop is not None:
                    self.stop.wait(delay)
                else:
                    time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if paused_at is not None:
                log.warning(
                    "Redis accepts writes again; resumed after a %.1fs pause",
                    time.monotonic() - paused_at,
                )
                if self.counters_key:
                    with contextlib.suppress(
                        redis.RedisError
                    ):  # a count is not worth another pause
                        super().execute_command("HINCRBY", self.counters_key, OOM_PAUSE_COUNTER, 1)  # type: ignore[no-untyped-call]
            return result


def connect(
    url: str,
    *,
    retries: int = 8,
    pause_when_full: bool = True,
    stop: threading.Event | None = None,
    counters_key: str | None = None,
    socket_timeout: float | None = None,
) -> redis.Redis:
    """A client that retries with bounded exponential back-off when the server goes away and,
    with `pause_when_full` (services; not the API, which answers 503 instead), waits out Redis
    at maxmemory (see `PausingRedis`)."""
    cls = PausingRedis if pause_when_full else redis.Redis
    client = cls.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=10,
        socket_keepalive=True,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
    )
    if isinstance(client, PausingRedis):
        client.stop, client.counters_key = stop, counters_key
    return client


def check_memory_policy(client: redis.Redis) -> None:
    """Refuse a Redis that would evict keys under memory pressure: that is silent data loss."""
    mem: Any = client.info("memory")
    policy = str(mem.get("maxmemory_policy", "noeviction"))
    if int(mem.get("maxmemory", 0)) > 0 and policy != "noeviction":
        raise RuntimeError(
            f"Redis maxmemory-policy is {policy!r}: under memory pressure Redis would delete "
            "queued samples; set it to noeviction (the run then pauses at maxmemory instead of "
            "losing data)"
        )


def memory_report(client: redis.Redis) -> dict[str, Any]:
    """Redis memory as /status shows it: used, peak, limit, and whether writes are being refused."""
    mem: Any = client.info("memory")
    limit = int(mem.get("maxmemory", 0))
    used = int(mem.get("used_memory", 0))
    counted = used - int(
        mem.get("mem_not_counted_for_evict", 0)
    )  # what Redis compares with the limit
    return {
        "used_bytes": used,
        "peak_bytes": int(mem.get("used_memory_peak", 0)),
        "maxmemory_bytes": limit,
        "policy": str(mem.get("maxmemory_policy", "")),
        "at_maxmemory": bool(limit and counted >= limit),
    }
