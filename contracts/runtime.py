"""What every long-running service shares: heartbeat, graceful stop, and the stage skeleton.

Every stage process (a rollout replica, a reward worker, the gatekeeper; as a `dapo` command or
hosted by Ray Serve) runs the same skeleton, `serve_stage`: start the heartbeat, run the stage
loop until asked to stop, write the final stats, release what the worker holds. The loop
repeats: reclaim entries abandoned by dead consumers (sooner than `queue.claim_idle_s` when their
heartbeat is gone: `Transport.reclaim`), read new entries, hand them to the worker's `handle`,
which finishes each with one atomic hop. A stage brings only a `StageHandler`: its handler, its
status, how it reads (`StageLoop`) and what to release.

The one error policy lives here, at the loop boundary only: Redis going away is waited out; an
entry whose handler raised stays pending, is retried at the next reclaim (every few seconds),
and is dead-lettered after `queue.max_deliveries` attempts; a worker whose handler fails more
batches in a row than that is broken rather than fed bad entries, and the loop raises so the
process exits and its supervisor replaces it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from contracts.bus import Entry, StreamBus, Telemetry, Transport, is_oom, open_bus
from contracts.bus.roles import consumed_stages
from contracts.config import ConfigError, DapoConfig, QueueConfig
from contracts.keys import Stage
from contracts.signing import held_key

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


PORTS_FROM = 20000
"""Lowest port `free_port` draws (Ray's worker ports end at 19999 by default)."""


def _ephemeral_ports_from() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free on loopback right now (for a rendezvous or a server started next).

    Drawn at random between PORTS_FROM and the kernel's ephemeral range, not from that range (as
    bind to port 0 would): any outgoing connection on the machine may take an ephemeral port as
    its source port between this check and the caller's bind, and a rendezvous then fails with
    EADDRINUSE (seen with two test workers busy connecting). Two callers draw the same port once
    in thousands; where the range is too small, the kernel's choice."""
    upper = _ephemeral_ports_from()
    for _ in range(64 if upper - PORTS_FROM >= 1000 else 0):
        port = random.randrange(PORTS_FROM, upper)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def instance_id(role: str, pid: int | None = None) -> str:
    """`<role>-<host>-<pid>`: unique per process, and derivable by a supervisor on the same host.

    It is also the instance's consumer name in every stream, from which `Keys.consumer_heartbeat`
    finds its heartbeat again, taking the role to end at the first `-`."""
    if "-" in role:
        raise ValueError(
            f"a service role cannot contain '-' (got {role!r}): its consumer name "
            "would not lead back to its heartbeat"
        )
    return f"{role}-{socket.gethostname()}-{os.getpid() if pid is None else pid}"


class Heartbeat:
    """A TTL key refreshed by a daemon thread; the value is the service's JSON status.

    If the process hangs or dies the key expires after `ttl_s`, which is how the API and the
    learner tell that an instance is gone. It does NOT prove the work loop is making progress:
    `status()` should report progress counters so a stuck loop is visible.
    """

    def __init__(
        self,
        telemetry: Telemetry,
        role: str,
        inst: str,
        ttl_s: float,
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        # A heartbeat must not pause when Redis is at maxmemory (the instance would look dead
        # after ttl_s): this client fails instead, and a refused SET falls back to PEXPIRE, which
        # Redis still accepts, so the last status stays visible.
        self.client = redis.Redis(connection_pool=telemetry.redis.connection_pool)
        self.key, self.ttl_s = telemetry.keys.heartbeat(role, inst), ttl_s
        self.base = {
            "role": role,
            "id": inst,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
        }
        self.status = status or (lambda: {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{role}", daemon=True)

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


@dataclass(frozen=True)
class StageLoop:
    """How a stage worker reads its stream: what differs between stages."""

    stage: Stage
    batch: int = 1
    """Entries per read, handed to `handle` together."""
    block: bool = True
    """Block on the read up to `queue.block_ms`; False: never block, call `idle` when empty (a
    replica waits on its own signal, which also rings for weight announcements)."""
    reclaim_every_s: float = 5.0
    start: Callable[[], None] | None = None
    """Called once, before the first read (a replica starts receiving weights)."""
    before_read: Callable[[], None] | None = None
    """Called before each read (a replica applies weight updates there)."""
    idle: Callable[[], None] | None = None
    """Called after a read that found nothing."""


class StageHandler(Protocol):
    """What a stage brings to `serve_stage`."""

    @property
    def loop(self) -> StageLoop: ...

    def handle(self, entries: list[Entry]) -> None:
        """Finish every entry with one hop (or a dead letter, or a hand back)."""

    def status(self) -> dict[str, Any]:
        """The heartbeat's payload and the final stats."""

    def close(self) -> None:
        """Release what the worker holds (an engine, a verifier sandbox)."""


class StageFailing(RuntimeError):
    """A stage's handler failed more batches in a row than an entry may be delivered: the worker
    is broken (an engine that died, a bug), not its input; the process exits to be replaced."""


def run_stage_loop(
    transport: Transport,
    loop: StageLoop,
    handle: Callable[[list[Entry]], None],
    *,
    queue: QueueConfig,
    stop: StopFlag,
) -> None:
    """Consume `loop.stage` until stopped. `handle` finishes each entry with a hop (or dead
    letter); while it works, its claims are renewed, so only a dead consumer's entries are
    reclaimed."""
    stage, batch = loop.stage, loop.batch
    if loop.start is not None:
        loop.start()
    last_reclaim, failed_in_a_row = 0.0, 0
    while not stop.stopping:
        entries: list[Entry] = []
        try:
            if loop.before_read is not None:
                loop.before_read()
            if time.monotonic() - last_reclaim > loop.reclaim_every_s:
                last_reclaim = time.monotonic()
                # A consumer whose heartbeat is gone loses its entries without the claim timeout.
                entries = transport.reclaim(
                    stage,
                    min_idle_s=queue.claim_idle_s,
                    max_deliveries=queue.max_deliveries,
                    count=batch,
                    heartbeat_ttl_s=queue.heartbeat_ttl_s,
                )
            if not entries:
                block_ms = queue.block_ms if loop.block else None
                entries = transport.read(stage, count=batch, block_ms=block_ms)
            if entries:
                ids = [entry_id for entry_id, _ in entries]
                with transport.claims_kept(stage, ids, every_s=queue.claim_idle_s / 3):
                    handle(entries)
                failed_in_a_row = 0
            elif loop.idle is not None:
                loop.idle()
        except redis.ConnectionError as exc:  # ride out a Redis restart; pending work is reclaimed
            log.warning("redis unavailable (%s); retrying", exc)
            stop.wait(1.0)
        except redis.ResponseError as exc:
            if stop.stopping and is_oom(exc):  # asked to stop while paused on a full Redis
                return
            failed_in_a_row = _failed(stage, entries, failed_in_a_row, queue, stop)
        except Exception:  # the loop boundary: log, leave entries pending for retry/dead-letter
            failed_in_a_row = _failed(stage, entries, failed_in_a_row, queue, stop)


def _failed(
    stage: Stage, entries: list[Entry], failed_in_a_row: int, queue: QueueConfig, stop: StopFlag
) -> int:
    """Log a failed round (inside its `except`); raise `StageFailing` once more rounds than
    `queue.max_deliveries` failed in a row, else count it and pause a second."""
    log.exception(
        "handler failed on %d entries of %s; they stay pending", len(entries), stage.stream
    )
    failed_in_a_row += 1
    if failed_in_a_row > queue.max_deliveries:
        raise StageFailing(f"{stage.stream}: {failed_in_a_row} rounds in a row failed") from None
    stop.wait(1.0)
    return failed_in_a_row


def serve_stage(ctx: ServiceContext, worker: StageHandler, queue: QueueConfig) -> None:
    """The skeleton of every stage process: heartbeat, the stage loop until stopped, final stats,
    release. Raises what the loop raises (`StageFailing`); the final stats are written anyway."""
    if ctx.beating is None:  # a host may start it first, to be visible once it is constructed
        ctx.heartbeat(queue.heartbeat_ttl_s, worker.status)
    try:
        run_stage_loop(ctx.bus, worker.loop, worker.handle, queue=queue, stop=ctx.stop)
    finally:
        ctx.write_final_stats(worker.status())
        ctx.stop_heartbeat()  # deletes the key: the learner stops counting this instance at once
        worker.close()


@dataclass
class ServiceContext:
    """What every service process starts with: its identity, its streams and its stop flag."""

    role: str
    inst: str
    bus: StreamBus
    """The whole bus: the stage's factory hands the stage only the parts it uses."""
    stop: StopFlag
    beating: Heartbeat | None = None

    def heartbeat(self, ttl_s: float, status: Callable[[], dict[str, Any]]) -> Heartbeat:
        self.beating = Heartbeat(self.bus, self.role, self.inst, ttl_s, status).start()
        return self.beating

    def beat_now(self) -> None:
        """Report a change at once (a replica's new policy version) instead of at the next beat."""
        if self.beating is not None:
            self.beating.beat()

    def stop_heartbeat(self) -> None:
        if self.beating is not None:
            self.beating.stop()

    def write_final_stats(self, stats: dict[str, Any]) -> None:
        """What the run summary reports about this instance after it is gone."""
        try:
            self.bus.write_final_stats(self.role, self.inst, stats)
        except redis.RedisError as exc:
            log.warning("%s %s: final stats not written: %s", self.role, self.inst, exc)


def service_context(cfg: DapoConfig, role: str, *, install_signals: bool = True) -> ServiceContext:
    """Connect to the run's Redis (config or DAPO_REDIS_URL) and create the consumer groups.

    `install_signals=False` where the process's main thread belongs to a host (Ray Serve).
    """
    url = cfg.redis_url_for(role)
    if not url:
        raise ConfigError(f"{role}: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)")
    stop = StopFlag()
    if install_signals:
        stop.install()
    inst = instance_id(role)
    bus = open_bus(url, cfg.queue.namespace, inst, stop=stop.event)
    bus.job_key = held_key()  # a dead letter counts in the ledger only if the learner signed it
    bus.check_memory_policy()
    bus.ensure_groups(consumed_stages(role, bus.keys))
    return ServiceContext(role, inst, bus, stop)
