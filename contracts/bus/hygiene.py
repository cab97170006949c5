"""Redis hygiene: values in Redis that this system did not write (planted, left by another
program, corrupted) are skipped, counted and, where a writer needs the key, replaced, so that one
garbage value neither stops a reader nor refuses every later write.

Readers skip and count (`skip_bad_value`, `bad_redis_values`); `write` replaces a key of the
wrong type; the scripts' own repairs (`scripts.COUNT`, `scripts.MAKE_ROOM_FOR_STREAM`) report
what they replaced, which `_count_repair` counts the same way."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from contracts.bus.core import BusCore, FencedError
from contracts.keys import Counter

log = logging.getLogger(__name__)
T = TypeVar("T")


BAD_VALUES_REMEMBERED = 1000
"""Malformed (key, value) pairs a process remembers so it logs and counts each once."""

WRONGTYPE = "WRONGTYPE"
"""Redis's error code for a command on a key of another type (also inside a script's error)."""

_KEY_TYPE_OF_WRITE = {
    "HSET": "hash",
    "HINCRBY": "hash",
    "HDEL": "hash",
    "SADD": "set",
    "XADD": "stream",
    "BITFIELD": "string",
}
"""The type a write command needs its key (its first argument) to hold: what `write` may replace."""


class RedisHygiene(BusCore):
    """Fenced writes that survive a key of the wrong type, counters that survive garbage, and
    reads that skip and count a malformed value."""

    def write(self, *command: Any) -> Any:
        """One write command (e.g. `write("HSET", key, field, value)`), fenced when this bus holds
        a fence; the raw Redis reply (no client-side parsing).

        A key of the wrong type (planted, or left by something else) would refuse this write
        for good: for the commands in `_KEY_TYPE_OF_WRITE` it is replaced and the write done
        (`_REPLACE_AND_CALL`), then counted as a bad value."""
        try:
            return self._write_once(*command)
        except redis.ResponseError as exc:
            needs = _KEY_TYPE_OF_WRITE.get(str(command[0]).upper())
            if WRONGTYPE not in str(exc) or needs is None:
                raise
        found, reply = self._fenced("replace_and_call", [command[1]], [needs, *command])
        found = found.decode() if isinstance(found, bytes) else str(found)
        if found not in (needs, "none"):  # else another writer replaced it first
            self.skip_bad_value(command[1], f"a {found} where a {needs} belongs; replaced")
        return reply

    def incr(self, counter: str, amount: int = 1) -> None:
        """Add to a `Counter` (or `restarts_counter(service)`). A counter holding garbage (not
        written by us) starts again from `amount` rather than failing the caller."""
        try:
            self.write("HINCRBY", self.keys.counters, str(counter), amount)
        except redis.ResponseError as exc:
            if "not an integer" not in str(exc):
                raise
            log.warning("counter %s held a non-integer value; restarting it at %d", counter, amount)
            self.write("HSET", self.keys.counters, str(counter), amount)

    def skip_bad_value(self, key: Any, problem: object, raw: bytes | str = b"") -> None:
        """Log and count a value read from Redis that does not parse; the reader skips it.

        Each (key, value) is logged and counted once per process: readers poll (the API every
        few seconds, the learner every step), and one planted value must not read as thousands."""
        name = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        if (name, raw) in self._bad_seen:
            return
        if len(self._bad_seen) >= BAD_VALUES_REMEMBERED:
            self._bad_seen.clear()
        self._bad_seen.add((name, raw))
        log.warning("skipping a malformed value in Redis at %s: %s", name, problem)
        with contextlib.suppress(
            redis.RedisError, FencedError
        ):  # a count is not worth failing the reader
            self.incr(Counter.BAD_REDIS_VALUES)

    def _int_at(self, key: Any, raw: bytes | None, default: T) -> int | T:
        """An integer read from `key`; anything else is skipped and counted like any malformed
        value, and reads as `default` (as does a missing value)."""
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            self.skip_bad_value(key, f"{raw!r} is not an integer", raw)
            return default

    def _read(self, default: Any, read: Callable[..., Any], key: Any, *args: Any) -> Any:
        """`read(key, *args)` (a client method: `hgetall`, `get`, ...), where a key of the wrong
        type (a hash where a string belongs, ...) is a malformed value like any other: skipped
        and counted, and `default` returned."""
        try:
            return read(key, *args)
        except redis.ResponseError as exc:
            if WRONGTYPE not in str(exc):
                raise
            self.skip_bad_value(key, "a value of the wrong type")
            return default

    def _count_repair(self, key: str, repair: bytes | str) -> None:
        """A writing script met a planted value where it writes (a count, `_COUNT`, or the
        downstream stream) and replaced it."""
        if repair:
            text = repair.decode("utf-8", "replace") if isinstance(repair, bytes) else repair
            self.skip_bad_value(key, f"{text}; replaced", text)
