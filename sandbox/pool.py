"""A pool of sandboxed worker processes that call one function on strings, with a hard deadline.

`Sandbox("pkg.mod:fn", workers=2, timeout_s=5)` starts the workers (`sandbox.worker`) and waits
until each has loaded the function: a function that cannot be loaded is a `SandboxStartError`
at start, naming it, not an error per call later. `call(args)` runs one call on the next free
worker (from any thread) and `call_many(args)` runs many, as many at once as there are workers,
each returning a `CallResult`; nothing a call does can make it raise or hang:

- past `timeout_s` the worker's whole process group is killed (SIGKILL: what the function forked
  goes with it) and replaced; the call's result says it timed out;
- a worker that dies, sends a malformed or oversized frame, or sends half a frame and stops,
  is a failed call with a reason (the parent never waits for a frame past the deadline);
- an exception in the function, or a result that is not a string, is a failed call with the
  exception's text.

Each worker runs as `python -I` (no PYTHON* variables, no working directory on the import
path) in a new session, in a private empty working directory, with an environment of PATH,
HOME, TMPDIR and LANG only (no credentials of this process) and no inherited descriptor but its
pipes, under the limits of `sandbox.worker` and the confinement of `sandbox.confine` (Landlock
and seccomp: no file outside its directory written, no run directory read, no network, no new
process, no signal or ptrace to another process). Where the host allows user namespaces
(`unshare -rn`) the worker also gets a network namespace of its own; when this process runs as
root the worker runs as `nobody` (uid 65534), with RLIMIT_NPROC. A worker that got neither
Landlock nor seccomp is refused (`SandboxStartError`) unless `DAPO_SANDBOX_ALLOW_UNCONFINED=1`;
`Sandbox.confinement` says what the workers got.

Workers are started from one thread that lives as long as the sandbox: the parent-death signal
fires when the starting thread ends, so a worker dies with the sandbox, not with a caller's
thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final

from sandbox.confine import LAYERS, UNCONFINED_ENV, UNPRIVILEGED_UID, Confinement
from sandbox.frames import FrameError, FrameReader, FrameTimeout, encode

log = logging.getLogger(__name__)

WORKER_SCRIPT: Final = Path(__file__).with_name("worker.py")
HOST_SOCKET_ENV: Final = "DAPO_SANDBOX_SOCKET"
"""Set: every sandbox of this process runs its workers in the sandbox host listening on this
Unix socket (`sandbox.host`, a container of its own), not as local processes."""
MAX_ARGS_CHARS: Final = 32_768
"""The longest argument string sent to a worker by default (a longer one fails the call
unsent); a frame holds at most 1 MiB of JSON (`sandbox.frames`)."""
MAX_CALL_RETRIES: Final = 2
"""Times a call goes to a new worker after the one it was sent to died before reading it (it
said nothing, not even that it started): bounds the work of a pool whose workers keep dying."""


class SandboxStartError(RuntimeError):
    """A worker could not load its function (or did not start)."""


@dataclass
class CallResult:
    ok: bool
    text: str
    """The function's result, or why the call failed (what a tool call returns to the model)."""
    timed_out: bool = False
    seconds: float = 0.0
    died: bool = False
    """The worker died while running the call (a crash, the CPU limit, a kill from outside)."""


def _result(reply: dict[str, Any]) -> CallResult:
    """A worker's reply frame as a result: its value, or its error text."""
    if reply.get("ok") is True and isinstance(reply.get("value"), str):
        return CallResult(True, reply["value"])
    error = reply.get("error")
    if reply.get("ok") is False and isinstance(error, str):
        return CallResult(False, f"error: {error[:500]}")
    return CallResult(False, "error: the sandbox worker sent a bad reply")


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare` can start a process in a network namespace here (as root directly,
    else in a user namespace of its own, `-rn`); containers with the default seccomp profile
    usually refuse it."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-n", "true"] if os.geteuid() == 0 else ["unshare", "-rn", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def other_uid_available() -> bool:
    """Whether workers can run as `nobody`: this process is root and `nobody` can start the
    interpreter (a Python installed under /root is not readable by it: the workers then keep
    this uid, and the log says so)."""
    if os.geteuid() != 0:
        return False
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", "pass"],
            capture_output=True,
            timeout=30,
            check=False,
            cwd="/",
            user=UNPRIVILEGED_UID,
            group=UNPRIVILEGED_UID,
            extra_groups=[],
        )
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        log.warning(
            "sandbox workers keep the services' uid: uid %d cannot run %s",
            UNPRIVILEGED_UID,
            sys.executable,
        )
    return done.returncode == 0


def _launch(network_namespace: bool, own_uid: bool) -> tuple[list[str], dict[str, Any]]:
    """The command prefix and Popen arguments that start a worker: in a network namespace where
    allowed, as `nobody` when this process is root (unshare drops the uid and the supplementary
    groups after it made the namespace; without unshare, Popen does)."""
    if os.geteuid() != 0:
        return (["unshare", "-rn", "--"] if network_namespace else []), {}
    if not own_uid:
        return (["unshare", "-n", "--"] if network_namespace else []), {}
    ids = str(UNPRIVILEGED_UID)
    if network_namespace:
        return ["unshare", "-n", "-S", ids, "-G", ids, "--"], {}
    return [], {"user": UNPRIVILEGED_UID, "group": UNPRIVILEGED_UID, "extra_groups": []}


class LocalWorker:
    """One worker process started here, and the parent's end of its pipes."""

    def __init__(self, *, network_namespace: bool, own_uid: bool) -> None:
        self.home = tempfile.mkdtemp(prefix="dapo-sandbox-")
        if own_uid:
            os.chown(self.home, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.home,
            "TMPDIR": self.home,
            "LANG": "C.UTF-8",
        }
        prefix, drop = _launch(network_namespace, own_uid)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=self.home,
            start_new_session=True,  # its own process group: a kill takes its children too
            close_fds=True,
            **drop,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.pid: int | None = self.proc.pid
        self.reader = FrameReader(self.proc.stdout.fileno())
        self.calls = 0
        os.set_blocking(self.stdin.fileno(), False)  # a worker that stops reading can't block us

    def send(self, message: dict[str, Any] | bytes, deadline: float) -> None:
        """Write the whole frame, waiting for the pipe to drain until `deadline` (a frame may be
        larger than the pipe's buffer). Raises FrameTimeout when the worker stops reading,
        OSError (BrokenPipeError) when it is gone."""
        _send(self.stdin.fileno(), message, deadline)

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def exit_code(self) -> int | None:
        return self.proc.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        shutil.rmtree(self.home, ignore_errors=True)


class RemoteWorker:
    """A worker of a sandbox host in another container (`sandbox.host`), reached over its Unix
    socket: the same frames, one connection per worker. Closing the connection is the kill (the
    host kills the worker); the worker's death closes it."""

    def __init__(self, socket_path: str, deadline: float) -> None:
        while True:  # the host may still be starting beside this stage
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.setblocking(False)
        self.pid: int | None = None  # the host's process, in its own container
        self.reader = FrameReader(self.sock.fileno())
        self.calls = 0
        self._closed = False

    def send(self, message: dict[str, Any] | bytes, deadline: float) -> None:
        _send(self.sock.fileno(), message, deadline)

    def exited(self) -> bool:
        """The host closed the connection (its worker died): a read would see end of file."""
        if self._closed:
            return True
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable) and not self.reader.pending() and not self.reader.feed()

    def exit_code(self) -> int | None:
        return None  # the host's to know

    def kill(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


Worker = LocalWorker | RemoteWorker


def _send(fd: int, message: dict[str, Any] | bytes, deadline: float) -> None:
    """Write the whole frame to a non-blocking `fd`, until `deadline` (see `LocalWorker.send`)."""
    data = memoryview(message if isinstance(message, bytes) else encode(message))
    while data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FrameTimeout("the sandbox worker stopped reading")
        _, writable, _ = select.select([], [fd], [], left)
        if writable:
            try:
                data = data[os.write(fd, data) :]
            except BlockingIOError:
                continue


class Sandbox:
    """Worker processes calling `function` (`"module:function"`, a function of one string that
    returns a string); see the module docstring. With `factory_args`, `function` is a factory:
    each worker calls it once with that string, before it says it is ready (where a checker
    loads what it needs: math-verify's SymPy, a user's module), and calls what it returns.
    `read_paths`: files or directories the worker may read besides the interpreter and the
    import path's packages (a reward function's file).

    Attributes (counts since start): `calls`, `errors` (failed calls, time-outs included),
    `timeouts`, `restarts` (workers replaced after a kill or a death)."""

    def __init__(
        self,
        function: str,
        *,
        workers: int = 2,
        timeout_s: float = 5.0,
        memory_bytes: int | None = 512 << 20,
        max_result_chars: int = 4096,
        allow_processes: bool = False,
        start_timeout_s: float = 30.0,
        calls_per_worker: int | None = None,
        paths: list[str] | None = None,
        layers: tuple[str, ...] = LAYERS,
        factory_args: str | None = None,
        read_paths: tuple[str, ...] = (),
        max_args_chars: int = MAX_ARGS_CHARS,
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("a sandbox needs at least one worker and a positive time limit")
        self.function = function
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.calls_per_worker = calls_per_worker
        self.max_args_chars = max_args_chars
        self.host_socket = os.environ.get(HOST_SOCKET_ENV) or None
        """A sandbox host's socket (`sandbox.host`): workers run in its container."""
        if self.host_socket:  # the host decides both
            self.network_isolation, self.own_uid = "sandbox host", False
        else:
            self.network_isolation = "namespace" if network_namespace_available() else "none"
            self.own_uid = other_uid_available()
        self.confinement: Confinement | None = None
        """What the last worker started got (`sandbox.confine`)."""
        self.hello = {
            "function": function,
            # The caller's import path, absolute: the worker finds the function where we do.
            "paths": paths if paths is not None else [str(Path(p).resolve()) for p in sys.path],
            "memory_bytes": memory_bytes,
            "max_result_chars": max_result_chars,
            "allow_processes": allow_processes,
            "cpu_seconds": timeout_s,  # a call cannot burn more CPU than its wall-clock limit
            "parent": os.getpid(),
            "network_namespace": self.network_isolation == "namespace",
            "own_uid": self.own_uid,
            "layers": list(layers),
            "read_paths": list(read_paths),
        }
        if factory_args is not None:
            self.hello["factory_args"] = factory_args
        # Every worker is started from this one thread (see the module docstring).
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="sandbox-spawn")
        self.calls = self.errors = self.timeouts = self.restarts = 0
        self._count = threading.Lock()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(workers):
            self._free.put(slot)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        self._workers: list[Worker | None] = [None] * workers
        try:  # at once: a worker may take seconds to load what its function imports
            started = list(self._threads.map(lambda _: self._start(), range(workers)))
            self._workers[:] = started
        except BaseException:
            self.close()
            raise

    # --- workers ---------------------------------------------------------------------------
    def _new_worker(self, deadline: float) -> Worker:
        if self.host_socket:
            return RemoteWorker(self.host_socket, deadline)
        return LocalWorker(
            network_namespace=self.network_isolation == "namespace", own_uid=self.own_uid
        )

    def _start(self) -> Worker:
        deadline = time.monotonic() + self.start_timeout_s
        try:
            worker = self._spawner.submit(self._new_worker, deadline).result()
        except OSError as exc:
            raise SandboxStartError(
                f"no sandbox host answers on {self.host_socket} ({type(exc).__name__}: {exc}): "
                "is the stage's sandbox container running?"
            ) from None
        try:
            worker.send(self.hello, deadline)
            reply = worker.reader.read(deadline)
        except (OSError, EOFError, FrameError, FrameTimeout) as exc:
            worker.kill()
            raise SandboxStartError(
                f"a sandbox worker for {self.function} did not start ({type(exc).__name__}: {exc})"
            ) from None
        if reply.get("ready") is not True:
            worker.kill()
            hint = (
                f" (the worker runs as uid {UNPRIVILEGED_UID}: the function's files must be "
                "readable by every user)"
                if self.own_uid and "PermissionError" in str(reply.get("error"))
                else ""
            )
            raise SandboxStartError(
                f"{self.function} could not be loaded in the sandbox: {reply.get('error')}{hint}"
            )
        confinement = Confinement.from_json(reply.get("confinement"))
        if not confinement.contained and os.environ.get(UNCONFINED_ENV) != "1":
            worker.kill()
            raise SandboxStartError(
                f"the kernel gave the sandbox worker for {self.function} neither Landlock nor "
                f"seccomp ({'; '.join(confinement.errors) or 'no reason given'}): its code "
                "could read every file this uid can, signal the services and open network "
                f"connections. Set {UNCONFINED_ENV}=1 to run it anyway."
            )
        if self.confinement is None:
            log.info("sandbox for %s: %s", self.function, confinement.describe())
        self.confinement = confinement
        return worker

    def _replace(self, slot: int) -> int | None:
        """Kill the worker of `slot` (a new one starts when the slot is next used); returns its
        exit code."""
        old = self._workers[slot]
        code = None
        if old is not None:
            old.kill()
            code = old.exit_code()
        self._workers[slot] = None
        with self._count:
            self.restarts += 1
        return code

    def _worker(self, slot: int) -> Worker:
        """The live worker of `slot`, started anew if it is gone."""
        worker = self._workers[slot]
        if worker is None or worker.exited():
            if worker is not None:
                self._replace(slot)
            worker = self._workers[slot] = self._start()
        return worker

    # --- calls -----------------------------------------------------------------------------
    def call(self, args: str) -> CallResult:
        """One call on the next free worker (waits for one); safe from several threads."""
        slot = self._free.get()
        try:
            result = self._call_on(slot, args)
        finally:
            self._free.put(slot)
        with self._count:
            self.calls += 1
            self.errors += not result.ok
            self.timeouts += result.timed_out
        return result

    def call_many(self, args: list[str]) -> list[CallResult]:
        """Every call, as many at once as there are workers; results in the order of `args`."""
        return list(self._threads.map(self.call, args))

    def _call_on(self, slot: int, args: str) -> CallResult:
        if len(args) > self.max_args_chars:
            return CallResult(False, f"error: the call is over {self.max_args_chars} characters")
        exit_code: int | None = None
        for _attempt in range(MAX_CALL_RETRIES + 1):
            try:
                worker = self._worker(slot)
            except SandboxStartError as exc:
                return CallResult(False, f"error: {exc}")
            # Not a counter: the function can read this call's id off the worker's stack, and
            # must not be able to guess the next call's.
            request = secrets.token_hex(8)
            try:
                message = encode({"args": args, "id": request})
            except FrameError as exc:
                return CallResult(False, f"error: the call cannot be sent ({exc})")
            started = time.monotonic()
            deadline = started + self.timeout_s
            try:
                worker.send(message, deadline)
                ack = worker.reader.read(deadline)
            except FrameTimeout:
                self._replace(slot)
                return self._timed_out(started)
            except (OSError, EOFError, FrameError):
                # It died (or broke) before it read the call: the call is not charged, and goes
                # to a new worker, a bounded number of times.
                exit_code = self._replace(slot)
                continue
            if ack.get("started") != request:
                self._replace(slot)
                return CallResult(False, "error: the sandbox worker sent a bad reply", seconds=0.0)
            worker.calls += 1
            return self._reply(slot, worker, request, started, deadline)
        return CallResult(
            False,
            f"error: not run: {MAX_CALL_RETRIES + 1} sandbox workers died before reading it "
            f"(last exit code {exit_code})",
        )

    def _timed_out(self, started: float) -> CallResult:
        return CallResult(
            False,
            f"error: the call ran past its {self.timeout_s:g} s limit and was stopped",
            timed_out=True,
            seconds=time.monotonic() - started,
        )

    def _reply(
        self, slot: int, worker: Worker, request: str, started: float, deadline: float
    ) -> CallResult:
        """The reply to the call the worker said it started."""
        try:
            reply = worker.reader.read(deadline)
        except FrameTimeout:
            self._replace(slot)
            return self._timed_out(started)
        except (EOFError, OSError):
            code = self._replace(slot)
            return CallResult(
                False,
                f"error: the sandbox worker died during the call (exit code {code})",
                seconds=time.monotonic() - started,
                died=True,
            )
        except FrameError as exc:
            self._replace(slot)
            return CallResult(
                False,
                f"error: the sandbox worker sent a bad reply ({exc})",
                seconds=time.monotonic() - started,
            )
        if reply.get("id") != request:  # a frame the function wrote for a call to come
            self._replace(slot)
            return CallResult(
                False,
                "error: the sandbox worker sent a bad reply (not this call's)",
                seconds=time.monotonic() - started,
            )
        result = _result(reply)
        result.seconds = time.monotonic() - started
        spent = self.calls_per_worker is not None and worker.calls >= self.calls_per_worker
        if spent or result.text.startswith("error: the sandbox worker"):
            self._replace(slot)
        return result

    # --- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.kill()
                self._workers[slot] = None
        self._spawner.shutdown(wait=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def pids(self) -> list[int | None]:
        return [None if w is None else w.pid for w in self._workers]
