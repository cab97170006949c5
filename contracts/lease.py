"""One learner at a time: a lease in Redis with a fencing token.

Two learners against one Redis (a redeploy whose new pod starts before the old one is gone, a
second `dapo learner` started by hand) would both claim groups, interleave policy versions and
write one checkpoint store. The learner therefore takes a lease before it touches anything:

- `acquire` takes a fresh token from a counter (tokens only grow) and sets the lease key to it
  with SET NX PX; while another learner holds the lease it waits (logging who holds it) up to
  `wait_s`, then raises `LeaseHeldError` naming the holder.
- A daemon thread renews the lease every `ttl_s / 3` with a compare-and-extend script, so a long
  step never loses it; a process that stops renewing (killed, paused, partitioned) loses it
  `ttl_s` later and the next learner may take over.
- The token is the fence: the learner's bus carries it (`BusCore.hold_fence`) and every write
  of the run state (ledger hops, issuing prompts, counters, policy version, learner state,
  weight announcements) is a script that checks, inside Redis, that the lease still holds the
  token. A learner that lost the lease, even one that was paused and does not know it yet, gets
  `FencedError` on its next write and writes nothing. `check()` guards what Redis cannot see:
  the learner calls it before every checkpoint.
- A vacant lease is taken back by its last holder's next write or renewal (Redis lost its data,
  or the holder was paused past the TTL and nobody took over: nobody else wrote meanwhile).

What this does NOT guarantee: a checkpoint written by a learner that loses its lease between
`check()` and the end of the write still lands in the store (the filesystem cannot check a
token); the successor never resumes from it unless it is newer than what the successor wrote,
and a learner that loses its lease stops at its next Redis write. Reads (taking work from a
stream) are not fenced: a superseded learner may hold claimed entries until it exits; they are
reclaimed like any dead consumer's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from contracts.bus import FencedError
from contracts.bus.core import BusCore

log = logging.getLogger(__name__)


class LeaseHeldError(RuntimeError):
    """Another learner held the lease for the whole wait."""


class LearnerLease:
    """The lease of one learner process (rank 0). `token` is '' until `acquire` succeeds."""

    def __init__(self, bus: BusCore, *, holder: str, ttl_s: float) -> None:
        self.bus, self.holder, self.ttl_s = bus, holder, ttl_s
        self.key = bus.keys.learner_lease
        self.token = ""
        self.lost = threading.Event()
        """Set by the renewer when the lease no longer holds our token."""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _renew(self) -> bool:
        """Extend the lease if it holds our token (`scripts.LEASE_RENEW`)."""
        ttl_ms = int(self.ttl_s * 1000)
        return bool(self.bus.scripts.run("lease_renew", [self.key], [self.token, ttl_ms]))

    def holder_now(self) -> str:
        raw = self.bus.redis.get(self.key)
        return "nobody" if raw is None else raw.decode("utf-8", "replace")  # type: ignore[union-attr]

    def acquire(self, wait_s: float, stop: threading.Event | None = None) -> str:
        """Take the lease (waiting up to `wait_s` for a holder to go), fence the bus with it and
        start renewing; returns the token."""
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            token = f"{int(self.bus.redis.incr(self.bus.keys.learner_fence))}:{self.holder}"
            if self.bus.redis.set(self.key, token, nx=True, px=int(self.ttl_s * 1000)):
                break
            holder = self.holder_now()
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise LeaseHeldError(
                    f"another learner holds the learner lease ({holder}) in namespace "
                    f"{self.bus.keys.ns!r}: only one learner may train a run at a time. Stop the "
                    f"other learner, or wait {self.ttl_s:.0f}s for a dead one's lease to expire, "
                    "then start again"
                )
            if not told:
                log.warning("waiting up to %.0fs for the learner lease, held by %s", wait_s, holder)
                told = True
            time.sleep(min(1.0, self.ttl_s / 10))
        self.token = token
        self.bus.hold_fence(token, self.ttl_s)
        self._renewer = threading.Thread(target=self._keep, name="lease-renewer", daemon=True)
        self._renewer.start()
        log.info("holding the learner lease (token %s)", token)
        return token

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                held = bool(self._renew())
            except redis.RedisError as exc:  # Redis restarting: try again; the TTL gives us time
                log.warning("could not renew the learner lease: %s", exc)
                continue
            if not held:
                log.error(
                    "lost the learner lease (now held by %s): this learner's writes will be "
                    "refused",
                    self.holder_now(),
                )
                self.lost.set()
                return

    def check(self) -> None:
        """Raise `FencedError` unless the lease still holds our token (before a checkpoint)."""
        held = self._renew()
        if self.lost.is_set() or not held:
            self.lost.set()
            raise FencedError(
                f"this learner no longer holds the learner lease (now {self.holder_now()}); not "
                "writing"
            )

    def release(self) -> None:
        """Stop renewing and give the lease up (a clean exit: the next learner need not wait)."""
        self._stop.set()
        if self.token:
            with contextlib.suppress(redis.RedisError):  # it expires on its own
                self.bus.scripts.run("lease_release", [self.key], [self.token])
