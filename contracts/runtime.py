"""What every long-running service shares: heartbeat, graceful stop, and the stage work loop.

A stage worker (rollout, reward, gatekeeper) repeats: reclaim entries abandoned by dead
consumers (sooner than `queue.claim_idle_s` when their heartbeat is gone: `StreamBus.reclaim`),
read new entries, hand them to its handler, which finishes each with one atomic hop.
The catch-all exception handler lives here, at the loop boundary only: an entry whose handler
raised stays pending, is retried at the next reclaim (every few seconds), and is dead-lettered
after `queue.max_deliveries` attempts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from contracts.bus import Entry, StreamBus, is_oom, open_bus
from contracts.config import ConfigError, DapoConfig, QueueConfig
from contracts.keys import Stage

log = logging.getLogger(__name__)

EXIT_BAD_CONFIG = 2
"""Exit status of a service whose configuration or command line was refused, or whose model
could not be fetched from the Hub (`ConfigError`; the message names what was wrong). Restarts
are left to the supervisor's limit: a fetch may fail for a moment."""
EXIT_NOT_THE_LEARNER = 3
"""Exit status of a learner that found (or lost) the learner lease to another learner. Worth a
restart: a crashed learner's successor can find its predecessor's lease until it expires."""
EXIT_CHECKPOINT_REFUSED = 4
"""Exit status of a learner whose newest checkpoint failed verification: not worth a restart,
which would meet the same files. A multi-rank learner exits through torchrun, which reports
any failure as 1, so the learner also leaves CHECKPOINT_REFUSED_FILE in the run directory."""
CHECKPOINT_REFUSED_FILE = "learner-refused-checkpoint.txt"
"""Written to `output_dir` by a learner that refused its checkpoint (the reason inside);
`dapo run` removes it before each learner start and does not restart a learner that left it."""


class StopFlag:
    """Set by SIGTERM/SIGINT; work loops check it between items and exit cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info(
            "received %s: finishing the current item, then exiting", signal.Signals(signum).name
        )
        self.event.set()

    @property
    def stopping(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        return self.event.wait(seconds)


def free_port() -> int:
    """A TCP port free on loopback right now (for a rendezvous or a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def instance_id(kind: str, pid: int | None = None) -> str:
    """`<kind>-<host>-<pid>`: unique per process, and derivable by a supervisor on the same host.

    It is also the instance's consumer name in every stream, from which `Keys.consumer_heartbeat`
    finds its heartbeat again, taking the kind to end at the first `-`."""
    if "-" in kind:
        raise ValueError(
            f"a service kind cannot contain '-' (got {kind!r}): its consumer name "
            "would not lead back to its heartbeat"
        )
    return f"{kind}-{socket.gethostname()}-{os.getpid() if pid is None else pid}"


class Heartbeat:
    """A TTL key refreshed by a daemon thread; the value is the service's JSON status.

    If the process hangs or dies the key expires after `ttl_s`, which is how the API and the
    learner tell that an instance is gone. It does NOT prove the work loop is making progress:
    `status()` should report progress counters so a stuck loop is visible.
    """

    def __init__(
        self,
        bus: StreamBus,
        kind: str,
        inst: str,
        ttl_s: float,
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        # A heartbeat must not pause when Redis is at maxmemory (the instance would look dead
        # after ttl_s): this client fails instead, and a refused SET falls back to PEXPIRE, which
        # Redis still accepts, so the last status stays visible.
        self.client = redis.Redis(connection_pool=bus.redis.connection_pool)
        self.key, self.ttl_s = bus.keys.heartbeat(kind, inst), ttl_s
        self.base = {
            "kind": kind,
            "id": inst,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
        }
        self.status = status or (lambda: {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{kind}", daemon=True)

    def beat(self) -> None:
        value = {**self.base, **self.status(), "at": time.time()}
        try:
            self.client.set(self.key, json.dumps(value), px=int(self.ttl_s * 1000))
        except redis.ResponseError as exc:
            if not is_oom(exc):
                raise
            self.client.pexpire(self.key, int(self.ttl_s * 1000))

    def _loop(self) -> None:
        while not self._stop.wait(max(self.ttl_s / 3, 0.2)):
            try:
                self.beat()
            except redis.RedisError as exc:  # keep beating once Redis is back
                log.warning("heartbeat failed: %s", exc)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(redis.RedisError):
            self.client.delete(self.key)


def run_stage_loop(
    bus: StreamBus,
    stage: Stage,
    handle: Callable[[list[Entry]], None],
    *,
    queue: QueueConfig,
    stop: StopFlag,
    batch: int = 1,
    reclaim_every_s: float = 5.0,
    idle: Callable[[], None] | None = None,
) -> None:
    """Consume `stage` until stopped. `handle` finishes each entry with a hop (or dead letter);
    while it works, its claims are renewed, so only a dead consumer's entries are reclaimed."""
    last_reclaim = 0.0
    while not stop.stopping:
        entries: list[Entry] = []
        try:
            if time.monotonic() - last_reclaim > reclaim_every_s:
                last_reclaim = time.monotonic()
                # A consumer whose heartbeat is gone loses its entries without the claim timeout.
                entries = bus.reclaim(
                    stage,
                    min_idle_s=queue.claim_idle_s,
                    max_deliveries=queue.max_deliveries,
                    count=batch,
                    heartbeat_ttl_s=queue.heartbeat_ttl_s,
                )
            if not entries:
                entries = bus.read(stage, count=batch, block_ms=queue.block_ms)
            if entries:
                with bus.claims_kept(
                    stage, [entry_id for entry_id, _ in entries], every_s=queue.claim_idle_s / 3
                ):
                    handle(entries)
            elif idle is not None:
                idle()
        except redis.ConnectionError as exc:
            log.warning("redis unavailable (%s); retrying", exc)
            stop.wait(1.0)
        except Exception:  # the loop boundary: log, leave entries pending for retry/dead-letter
            log.exception(
                "handler failed on %d entries of %s; they stay pending", len(entries), stage.stream
            )
            stop.wait(1.0)


@dataclass
class ServiceContext:
    """What every service process starts with: its identity, its streams and its stop flag."""

    kind: str
    inst: str
    bus: StreamBus
    stop: StopFlag

    def heartbeat(self, ttl_s: float, status: Callable[[], dict[str, Any]]) -> Heartbeat:
        return Heartbeat(self.bus, self.kind, self.inst, ttl_s, status).start()

    def write_final_stats(self, stats: dict[str, Any]) -> None:
        """What the run summary reports about this instance after it is gone."""
        try:
            self.bus.write_final_stats(self.kind, self.inst, stats)
        except redis.RedisError as exc:
            log.warning("%s %s: final stats not written: %s", self.kind, self.inst, exc)


def service_context(cfg: DapoConfig, kind: str, *, install_signals: bool = True) -> ServiceContext:
    """Connect to the run's Redis (config or DAPO_REDIS_URL) and create the consumer groups.

    `install_signals=False` where the process's main thread belongs to a host (Ray Serve).
    """
    url = cfg.redis_url
    if not url:
        raise ConfigError(f"{kind}: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)")
    stop = StopFlag()
    if install_signals:
        stop.install()
    inst = instance_id(kind)
    bus = open_bus(url, cfg.queue.namespace, inst, stop=stop.event)
    bus.check_memory_policy()
    bus.ensure_groups()
    return ServiceContext(kind, inst, bus, stop)
