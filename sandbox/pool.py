"""A pool of sandboxed worker processes that call one function on strings, with a hard deadline.

`Sandbox("pkg.mod:fn", workers=2, timeout_s=5)` starts the workers (`sandbox.worker`) and waits
until each has loaded the function: a function that cannot be loaded is a `SandboxStartError`
at start, naming it, not an error per call later. `call_many(args)` runs the calls on the
workers concurrently and returns one `CallResult` per call, in order; nothing a call does can
make it raise or hang:

- past `timeout_s` the worker's whole process group is killed (SIGKILL: what the function forked
  goes with it) and replaced; the call's result says it timed out;
- a worker that dies, sends a malformed or oversized frame, or sends half a frame and stops,
  is a failed call with a reason (the parent never waits for a frame past the deadline);
- an exception in the function, or a result that is not a string, is a failed call with the
  exception's text.

Each worker runs as `python -I` (no PYTHON* variables, no working directory on the import
path) in a new session, in a private empty working directory, with an environment of PATH,
HOME, TMPDIR and LANG only (no credentials of this process), under the limits of
`sandbox.worker` (address space, file sizes, open files; no network sockets; no new processes
unless `allow_processes`). Where the host allows user namespaces (`unshare -rn`), the worker
also runs in a network namespace of its own (`Sandbox.network_isolation` says which applies).
The function itself runs with this user's file permissions: it can read what this user can.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final

from sandbox.frames import FrameError, FrameReader, FrameTimeout, encode

log = logging.getLogger(__name__)

WORKER_SCRIPT: Final = Path(__file__).with_name("worker.py")
MAX_ARGS_CHARS: Final = 32_768
"""The longest argument string sent to a worker (a longer one fails the call unsent)."""


class SandboxStartError(RuntimeError):
    """A worker could not load its function (or did not start)."""


@dataclass
class CallResult:
    ok: bool
    text: str
    """The function's result, or why the call failed (what a tool call returns to the model)."""
    timed_out: bool = False
    seconds: float = 0.0


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare -rn` can start a process here (user namespaces allowed, the tool on
    PATH); containers with the default seccomp profile usually refuse it."""
    if shutil.which("unshare") is None:
        return False
    try:
        return (
            subprocess.run(
                ["unshare", "-rn", "true"], capture_output=True, timeout=10, check=False
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


class _Worker:
    """One worker process and the parent's end of its pipes."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.home = tempfile.mkdtemp(prefix="dapo-sandbox-")
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.home,
            "TMPDIR": self.home,
            "LANG": "C.UTF-8",
        }
        prefix = ["unshare", "-rn", "--"] if sandbox.network_isolation == "namespace" else []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=self.home,
            start_new_session=True,  # its own process group: a kill takes its children too
            close_fds=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.reader = FrameReader(self.proc.stdout.fileno())
        self.calls = 0
        os.set_blocking(self.stdin.fileno(), False)  # a worker that stops reading can't block us

    def send(self, message: dict[str, Any]) -> None:
        """Raises OSError (BrokenPipeError, BlockingIOError) when the worker can't take it."""
        data = memoryview(encode(message))
        while data:
            data = data[os.write(self.stdin.fileno(), data) :]

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


class Sandbox:
    """Worker processes calling `function` (`"module:function"`, a function of one string that
    returns a string); see the module docstring.

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
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("a sandbox needs at least one worker and a positive time limit")
        self.function = function
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.calls_per_worker = calls_per_worker
        self.network_isolation = "namespace" if network_namespace_available() else "audit-hook"
        self.hello = {
            "function": function,
            # The caller's import path, absolute: the worker finds the function where we do.
            "paths": paths if paths is not None else [str(Path(p).resolve()) for p in sys.path],
            "memory_bytes": memory_bytes,
            "max_result_chars": max_result_chars,
            "allow_processes": allow_processes,
        }
        self.calls = self.errors = self.timeouts = self.restarts = 0
        self._workers: list[_Worker | None] = [None] * workers
        try:
            for slot in range(workers):
                self._workers[slot] = self._start()
        except BaseException:
            self.close()
            raise

    # --- workers ---------------------------------------------------------------------------
    def _start(self) -> _Worker:
        worker = _Worker(self)
        try:
            worker.send(self.hello)
            reply = worker.reader.read(time.monotonic() + self.start_timeout_s)
        except (OSError, EOFError, FrameError, FrameTimeout) as exc:
            worker.kill()
            raise SandboxStartError(
                f"a sandbox worker for {self.function} did not start ({type(exc).__name__}: {exc})"
            ) from None
        if reply.get("ready") is not True:
            worker.kill()
            raise SandboxStartError(
                f"{self.function} could not be loaded in the sandbox: {reply.get('error')}"
            )
        return worker

    def _replace(self, slot: int) -> None:
        old = self._workers[slot]
        if old is not None:
            old.kill()
        self._workers[slot] = None
        self.restarts += 1

    def _worker(self, slot: int) -> _Worker:
        """The live worker of `slot`, started anew if it is gone."""
        worker = self._workers[slot]
        if worker is None or worker.proc.poll() is not None:
            if worker is not None:
                self._replace(slot)
            worker = self._workers[slot] = self._start()
        return worker

    # --- calls -----------------------------------------------------------------------------
    def call(self, args: str) -> CallResult:
        return self.call_many([args])[0]

    def call_many(self, args: list[str]) -> list[CallResult]:
        """Run every call, up to one per worker at a time; results in the order of `args`."""
        results: list[CallResult | None] = [None] * len(args)
        queue = list(range(len(args)))[::-1]
        busy: dict[int, tuple[int, float, float]] = {}  # slot -> (call, started, deadline)
        while queue or busy:
            for slot in range(len(self._workers)):
                if not queue:
                    break
                if slot in busy:
                    continue
                index = queue.pop()
                started = self._dispatch(slot, args[index], results, index)
                if started is not None:
                    busy[slot] = (index, started, started + self.timeout_s)
            if busy:
                self._collect(busy, results)
        self.calls += len(args)
        done = [r for r in results if r is not None]
        self.errors += sum(not r.ok for r in done)
        self.timeouts += sum(r.timed_out for r in done)
        return done

    def _dispatch(
        self, slot: int, args: str, results: list[CallResult | None], index: int
    ) -> float | None:
        """Send one call to the worker of `slot`; its start time, or None if it ended unsent."""
        if len(args) > MAX_ARGS_CHARS:
            results[index] = CallResult(False, f"error: the call is over {MAX_ARGS_CHARS} chars")
            return None
        for attempt in range(2):  # a worker found dead before it read the call: once more
            try:
                worker = self._worker(slot)
                worker.send({"args": args})
                worker.calls += 1
                return time.monotonic()
            except SandboxStartError as exc:
                results[index] = CallResult(False, f"error: {exc}")
                return None
            except (OSError, FrameError):
                self._replace(slot)
                if attempt:
                    results[index] = CallResult(False, "error: the sandbox worker was not ready")
        return None

    def _collect(
        self, busy: dict[int, tuple[int, float, float]], results: list[CallResult | None]
    ) -> None:
        """Wait for the first reply or deadline among the busy workers and settle what is due."""
        now = time.monotonic()
        wait = max(0.0, min(deadline for _, _, deadline in busy.values()) - now)
        readers = {self._workers[slot].reader.fd: slot for slot in busy}  # type: ignore[union-attr]
        readable, _, _ = select.select(list(readers), [], [], wait)
        now = time.monotonic()
        for fd in readable:
            slot = readers[fd]
            index, started, _ = busy[slot]
            worker = self._workers[slot]
            assert worker is not None
            result = self._reply(worker)
            if result is None:
                continue  # part of a frame: wait for the rest until the deadline
            result.seconds = now - started
            results[index] = result
            del busy[slot]
            broken = not result.ok and result.text.startswith("error: the sandbox worker")
            spent = bool(self.calls_per_worker) and worker.calls >= (self.calls_per_worker or 0)
            if broken or spent:
                self._replace(slot)
        for slot, (index, started, deadline) in list(busy.items()):
            if now >= deadline:
                results[index] = CallResult(
                    False,
                    f"error: the call ran past its {self.timeout_s:g} s limit and was stopped",
                    timed_out=True,
                    seconds=now - started,
                )
                del busy[slot]
                self._replace(slot)

    @staticmethod
    def _reply(worker: _Worker) -> CallResult | None:
        """The worker's answer if a whole frame is there, None if only part of one is."""
        try:
            alive = worker.reader.feed()
            if not worker.reader.pending():
                if alive:
                    return None
                return CallResult(False, "error: the sandbox worker crashed during the call")
            reply = worker.reader.take()
        except FrameError as exc:
            return CallResult(False, f"error: the sandbox worker sent a bad reply ({exc})")
        except OSError:
            return CallResult(False, "error: the sandbox worker crashed during the call")
        if reply.get("ok") is True and isinstance(reply.get("value"), str):
            return CallResult(True, reply["value"])
        error = reply.get("error")
        if reply.get("ok") is False and isinstance(error, str):
            return CallResult(False, f"error: {error[:500]}")
        return CallResult(False, "error: the sandbox worker sent a bad reply")

    # --- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.kill()
                self._workers[slot] = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def pids(self) -> list[int | None]:
        return [None if w is None else w.proc.pid for w in self._workers]
