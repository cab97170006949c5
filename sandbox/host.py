"""A sandbox host: sandbox workers for a stage that runs in another container.

In docker-compose, Kubernetes and the RayService's worker pods each stage that runs untrusted
code (the rollout replicas' tools, the reward workers' checkers) has a sandbox container beside
it: the same image, another uid, no secret in its environment, no network (compose:
`network_mode: none`; Kubernetes: a pod shares its network, so the workers' own seccomp and
Landlock layers refuse it). This process runs there (`dapo sandbox-host`) and listens on a Unix
socket in a volume the two containers share. The stage's `sandbox.pool.Sandbox` connects to it when
`DAPO_SANDBOX_SOCKET` names the socket, one connection per worker; for each, this host starts a
worker here exactly as the pool does locally (`sandbox.pool.LocalWorker`: `python -I`, a private
directory, confined) and relays the frames both ways. The first frame, the worker's hello, is
completed here: the parent whose death ends the worker, and what this host allows (a network
namespace, another uid), are this host's, not the caller's to say.

A connection that closes kills its worker (the stage gave up on a call: a time-out); a worker
that exits closes its connection (the stage sees the worker die).

Only the uids this host is told to serve may connect (`--allow-uid`; by default its own): the
kernel names the caller's uid (`SO_PEERCRED`), so a process under any other uid that can reach
the socket is refused before a worker starts, and counted (`refused_uids`). Deployed, the host
serves the stage's uid alone, so this host's own workers (which run as its uid or another of
their own) are refused too; a connection from the host's own uid that it does not serve is its
container's health probe, closed without a word. What this does NOT guarantee: that the caller
is a stage of this run rather than another process of an allowed uid, nor fairness between
callers beyond `max_workers`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

from sandbox.frames import MAX_FRAME_BYTES, FrameError, FrameReader, FrameTimeout, encode
from sandbox.pool import (
    HOST_SOCKET_ENV,
    LocalWorker,
    network_namespace_available,
    other_uid_available,
)

log = logging.getLogger(__name__)

SOCKET_ENV: Final = HOST_SOCKET_ENV
"""The socket a stage's sandboxes connect to; unset: workers are local processes."""
HELLO_TIMEOUT_S: Final = 30.0
"""How long a connection may take to send its worker's hello."""
RELAY_BUFFER_BYTES: Final = 4 * MAX_FRAME_BYTES
"""Bytes a relay holds for a side that does not read (a frame is at most `MAX_FRAME_BYTES`):
past it the session ends and its worker is killed."""


class SandboxHost:
    """Listens on `socket_path`; every connection gets a worker of its own (see the module
    docstring). `serve_forever` until `stop()`."""

    def __init__(
        self,
        socket_path: str,
        *,
        max_workers: int = 64,
        allowed_uids: frozenset[int] | None = None,
    ) -> None:
        """`allowed_uids`: the callers' uids to serve (None: this host's own uid only)."""
        self.socket_path = socket_path
        self.max_workers = max_workers
        self.allowed_uids = frozenset({os.getuid()}) if allowed_uids is None else allowed_uids
        self.refused_uids = 0
        """Connections refused for their caller's uid (health probes not counted)."""
        self._warned_at: dict[int, float] = {}  # uid -> when its last refusal was logged
        self.network_namespace = network_namespace_available()
        self.own_uid = other_uid_available()
        self._active = threading.BoundedSemaphore(max_workers)
        # Every worker is started from this one thread: their parent-death signal fires when it
        # ends, which is when this host does.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="sandbox-spawn")
        self._stop = threading.Event()
        self._pids: set[int] = set()
        Path(socket_path).unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(socket_path)
        # The stage runs under another uid: anyone who can enter the directory may connect, and
        # the caller's uid decides whether it gets a worker (`_admit`).
        os.chmod(socket_path, 0o666)
        self._listener.listen(max_workers)

    def serve_forever(self) -> None:
        log.info(
            "sandbox host on %s for uids %s (network namespace: %s, workers as another uid: %s)",
            self.socket_path,
            sorted(self.allowed_uids),
            self.network_namespace,
            self.own_uid,
        )
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self._listener], [], [], 0.5)
                if not readable:
                    continue
                conn, _ = self._listener.accept()
            except (OSError, ValueError):  # closed by stop()
                if self._stop.is_set():
                    return
                raise
            if not self._admit(conn):
                conn.close()
                continue
            if not self._active.acquire(blocking=False):
                log.warning("refused a connection: %d workers already run", self.max_workers)
                conn.close()
                continue
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> bool:
        """Whether the caller of `conn` may have a worker: its uid is one this host serves. A
        refusal is counted and logged (once a minute per uid, so a caller cannot flood the log);
        this host's own uid, unserved, is its health probe and is neither."""
        try:
            uid = peer_uid(conn)
        except OSError as exc:  # the kernel did not say who called: nobody we serve
            self.refused_uids += 1
            log.warning("refused a connection whose caller's uid is unknown: %s", exc)
            return False
        if uid in self.allowed_uids:
            return True
        if uid == os.getuid():
            return False
        self.refused_uids += 1
        now = time.monotonic()
        if now - self._warned_at.get(uid, -math.inf) >= 60.0:
            self._warned_at[uid] = now
            log.warning(
                "refused a connection from uid %d: this host serves uids %s (--allow-uid)",
                uid,
                sorted(self.allowed_uids),
            )
        return False

    def pids(self) -> list[int]:
        """The workers running now (each the leader of its process group)."""
        return sorted(self._pids)

    def stop(self) -> None:
        """Stop accepting (idempotent); sessions in progress end with their workers."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._listener.close()
        Path(self.socket_path).unlink(missing_ok=True)
        self._spawner.shutdown(wait=False)

    def _session(self, conn: socket.socket) -> None:
        worker: LocalWorker | None = None
        try:
            conn.setblocking(True)
            reader = FrameReader(conn.fileno())
            hello = reader.read(time.monotonic() + HELLO_TIMEOUT_S)
            hello |= {  # this host's to say, not the caller's
                "parent": os.getpid(),
                "network_namespace": self.network_namespace,
                "own_uid": self.own_uid,
            }
            worker = self._spawner.submit(
                LocalWorker, network_namespace=self.network_namespace, own_uid=self.own_uid
            ).result()
            self._pids.add(worker.proc.pid)
            # What the caller sent after its hello (its first call) follows it.
            _relay(conn, worker, encode(hello) + bytes(reader.buffer))
        except EOFError:
            pass  # closed before its hello
        except (OSError, FrameError, FrameTimeout, ValueError) as exc:
            log.warning("sandbox session ended: %s: %s", type(exc).__name__, exc)
        finally:
            if worker is not None:
                worker.kill()
                self._pids.discard(worker.proc.pid)
            with contextlib.suppress(OSError):
                conn.close()
            self._active.release()


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel recorded it when
    that process connected (Linux `SO_PEERCRED`: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    _pid, uid, _gid = struct.unpack("iII", creds)
    return int(uid)


def _relay(conn: socket.socket, worker: LocalWorker, first: bytes) -> None:
    """Bytes both ways until either side closes or stalls past `RELAY_BUFFER_BYTES`: the
    caller's frames to the worker's stdin, the worker's stdout to the caller (who bounds what it
    reads, as from a local worker). Nothing here blocks on one side: a worker that stops reading
    its stdin must not keep the relay from seeing the caller give up (which kills the worker)."""
    assert worker.proc.stdout is not None
    caller, out, into = conn.fileno(), worker.proc.stdout.fileno(), worker.stdin.fileno()
    conn.setblocking(False)  # the worker's stdin is non-blocking already (LocalWorker)
    to_worker, to_caller = bytearray(first), bytearray()
    while len(to_worker) <= RELAY_BUFFER_BYTES and len(to_caller) <= RELAY_BUFFER_BYTES:
        writers = [fd for fd, pending in ((into, to_worker), (caller, to_caller)) if pending]
        readable, writable, _ = select.select([caller, out], writers, [])
        if caller in readable:
            data = conn.recv(1 << 16)
            if not data:
                return  # the caller gave up: the worker is killed
            to_worker += data
        if out in readable:
            data = os.read(out, 1 << 16)
            if not data:
                return  # the worker is gone: the caller sees its connection close
            to_caller += data
        for fd, pending in ((into, to_worker), (caller, to_caller)):
            if fd in writable:
                with contextlib.suppress(BlockingIOError):
                    del pending[: os.write(fd, pending)]
    log.warning("sandbox session ended: over %d bytes waiting in the relay", RELAY_BUFFER_BYTES)


def serve(
    socket_path: str, *, max_workers: int = 64, allowed_uids: frozenset[int] | None = None
) -> int:
    """`dapo sandbox-host`: serve until SIGTERM or Ctrl-C."""
    import signal

    host = SandboxHost(socket_path, max_workers=max_workers, allowed_uids=allowed_uids)
    signal.signal(signal.SIGTERM, lambda *_: host.stop())
    try:
        host.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        host.stop()
    return 0
