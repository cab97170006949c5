"""What every part of the bus stands on: the connection, the run's key names, the consumer name,
the registered scripts and the fence (writes that happen only while this process holds the
learner lease)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Self

import redis

from contracts.bus.connection import check_memory_policy, memory_report
from contracts.bus.library import BusScripts
from contracts.keys import Keys, Stage
from contracts.signing import WeightKey

Fields = dict[bytes, bytes]
Entry = tuple[str, Fields]


class FencedError(RuntimeError):
    """A write was refused because this process no longer holds the learner lease: another
    learner took over (see `contracts.lease`). The process must stop writing and exit."""


class BusCore:
    """The connection, keys and fence of a `StreamBus`; the concerns built on it (`hygiene`,
    `transport`, `run_state`, `telemetry`) add the methods."""

    def __init__(self, client: redis.Redis, keys: Keys, consumer: str) -> None:
        self.redis = client
        self.keys = keys
        self.consumer = consumer
        self.scripts = BusScripts(client)
        self._bad_seen: set[tuple[str, bytes | str]] = set()  # see skip_bad_value
        self.job_key: WeightKey | None = None
        """The learner's key (public or private), where this process holds it: a dead letter
        then counts in the ledger only if its job is signed (`Transport.dead_letter`)."""
        self.fence: tuple[str, str, int] = ("", "", 0)
        """(lease key, token, TTL ms) once this bus writes for a lease holder (`hold_fence`);
        every write of the run state then happens only while the token is the lease's."""

    def as_consumer(self, consumer: str) -> Self:
        """The same streams and connection, read under another consumer name (the learner's
        drain reads undelivered jobs without taking over its own pending entries)."""
        other = type(self)(self.redis, self.keys, consumer)
        # One connection, one server: the scripts (and what they learned of it) are shared.
        other.fence, other.job_key, other.scripts = self.fence, self.job_key, self.scripts
        return other

    def hold_fence(self, token: str, ttl_s: float) -> None:
        """Write only while the learner lease holds `token` (the learner, after taking it)."""
        self.fence = (self.keys.learner_lease, token, int(ttl_s * 1000))

    def _fenced(self, script: str, keys: list[Any], args: list[Any]) -> Any:
        """Run script `script` (a name of `library.FUNCTIONS`) behind the fence."""
        lease, token, ttl_ms = self.fence
        try:
            return self.scripts.run(script, [lease, *keys], [token, ttl_ms, *args])
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                raise FencedError(
                    "refused a write to Redis: this learner's lease token "
                    f"{self.fence[1]!r} was superseded (another learner holds the lease now)"
                ) from None
            raise

    def _write_once(self, *command: Any) -> Any:
        if not self.fence[0]:
            return self.redis.execute_command(*command)  # type: ignore[no-untyped-call]
        return self._fenced("call", [], list(command))

    def ensure_groups(self, stages: Iterable[Stage] | None = None) -> None:
        """Create the consumer groups of `stages`, default every stage's (idempotent; MKSTREAM
        creates the stream). A service creates only those it reads (`roles.consumed_stages`):
        its Redis user may not write the other streams."""
        for stage in self.keys.stages if stages is None else stages:
            try:
                self.redis.xgroup_create(stage.stream, stage.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def clear_namespace(self) -> None:
        """Delete every key of this run's namespace (a fresh run)."""
        for key in self.redis.scan_iter(match=f"{self.keys.ns}:*", count=1000):
            self.redis.delete(key)

    def check_memory_policy(self) -> None:
        check_memory_policy(self.redis)

    def memory_report(self) -> dict[str, Any]:
        return memory_report(self.redis)

    def ping(self) -> bool:
        return bool(self.redis.ping())

    def close(self) -> None:
        self.redis.close()
