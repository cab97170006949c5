"""What runs in a sandbox worker process (`sandbox.pool` starts it as a script: `python -I`, so
neither the environment's PYTHON* variables nor the working directory reach its import path).

It reads a hello frame (the function to load, the import path, the limits), applies the limits
and the confinement, loads the function and says whether it is ready and what confinement it
got; then, one frame at a time, calls the function on the frame's `args` string and answers with
its result string or an error text, echoing the request's `id` (a reply the function forged on
the pipe for a later call cannot pass for that call's). Applied before any code of the function
is imported:

- `sandbox.confine.confine`: a parent-death signal, no-new-privileges, Landlock (writes only in
  the private directory, reads only the interpreter and the import path's packages, no TCP, no
  signal out of the sandbox) and a seccomp filter (no network socket, no new process, no exec,
  no signal to another process, no ptrace); RLIMIT_NPROC under a uid of its own;

- an address-space cap (RLIMIT_AS), a CPU-time budget per call (RLIMIT_CPU), no core files,
  a cap on file sizes and open files;
- an audit hook (it cannot be removed once installed) that refuses network sockets (every
  family but AF_UNIX) and, unless allowed, starting processes (fork, exec, spawn, subprocess,
  os.system), with a clear error for honest code; the kernel's layers above are what hold
  against code that calls libc through ctypes. The sandbox also starts the worker in a network
  namespace of its own where the host allows one.

Frames go out on a private copy of the original stdout; fd 1 and 2 are pointed at /dev/null, so
whatever the function prints never mixes with them.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: make `sandbox` importable (the project root)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from sandbox.confine import LAYERS, confine, die_with_parent
from sandbox.frames import FrameError, read_frame_blocking, write_frame

PROCESS_EVENTS = frozenset(
    {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system"}
    | {"subprocess.Popen", "pty.spawn", "os.startfile"}
)
SAFE_ENV = ("PATH", "HOME", "TMPDIR", "LANG")
"""The only environment variables a sandboxed process sees (none carries a credential)."""
MAX_FILE_BYTES = 64 << 20
MAX_OPEN_FILES = 256


def apply_limits(memory_bytes: int | None) -> None:
    for limit, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, MAX_FILE_BYTES),
        (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
        (resource.RLIMIT_AS, memory_bytes),
    ):
        if value is None:
            continue
        _, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def limit_cpu(seconds: float | None) -> None:
    """Let the next call use `seconds` of CPU time more than this process has used so far
    (RLIMIT_CPU; past it the kernel ends the process, which the parent sees as a crash)."""
    if seconds is None:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def install_guard(*, allow_processes: bool) -> None:
    def guard(event: str, args: tuple[Any, ...]) -> None:
        if event == "socket.__new__" and args[1] != socket.AF_UNIX:  # -1: the default, AF_INET
            raise PermissionError("network access is not allowed in the sandbox")
        if event in ("socket.connect", "socket.bind", "socket.sendto") and isinstance(
            args[1], tuple
        ):
            raise PermissionError("network access is not allowed in the sandbox")
        if not allow_processes and event in PROCESS_EVENTS:
            raise PermissionError(f"starting processes is not allowed in the sandbox ({event})")

    sys.addaudithook(guard)


def load_function(spec: str) -> Any:
    module_name, _, name = spec.partition(":")
    import importlib

    function = getattr(importlib.import_module(module_name), name)
    if not callable(function):
        raise TypeError(f"{spec} is a {type(function).__name__}, not a function")
    return function


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:500] + "..."


def serve(inbox: int, outbox: int) -> int:
    hello = read_frame_blocking(inbox)
    if hello is None:
        return 0
    sys.path[:] = [str(p) for p in hello.get("paths", [])] + sys.path
    max_chars = int(hello.get("max_result_chars", 4096))
    allow_processes = bool(hello.get("allow_processes", False))
    try:
        if isinstance(hello.get("parent"), int):
            die_with_parent(hello["parent"])
        apply_limits(hello.get("memory_bytes"))
        confinement = confine(
            private_dir=os.getcwd(),
            import_path=[*sys.path, *(str(p) for p in hello.get("read_paths", ()))],
            allow_processes=allow_processes,
            network_namespace=bool(hello.get("network_namespace")),
            own_uid=bool(hello.get("own_uid")),
            layers=[str(x) for x in hello.get("layers", LAYERS)],
        )
        install_guard(allow_processes=allow_processes)
        function = load_function(str(hello["function"]))
        if isinstance(hello.get("factory_args"), str):  # a factory: called once, here
            function = function(hello["factory_args"])
    except BaseException as exc:  # anything the function's import does: say it, then exit
        write_frame(outbox, {"ready": False, "error": describe(exc)})
        return 1
    write_frame(outbox, {"ready": True, "confinement": confinement.to_json()})
    while True:
        try:
            request = read_frame_blocking(inbox)
        except FrameError:
            return 1
        if request is None:
            return 0
        # Read, and about to run: a death from here on is this call's (the parent charges it),
        # a death before is not (the parent sends the call to a new worker).
        write_frame(outbox, {"started": request.get("id")})
        try:
            limit_cpu(hello.get("cpu_seconds"))
            value = function(str(request.get("args", "")))
            if not isinstance(value, str):
                raise TypeError(f"the function returned a {type(value).__name__}, not a str")
            reply: dict[str, Any] = {"ok": True, "value": value[:max_chars]}
        except MemoryError:
            reply = {"ok": False, "error": "MemoryError: the call ran out of memory"}
        except BaseException as exc:  # the function's failure (SystemExit too) is its result
            reply = {"ok": False, "error": describe(exc)}
        write_frame(outbox, {**reply, "id": request.get("id")})


def main() -> int:
    outbox = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        return serve(0, outbox)
    except BaseException:  # a protocol failure: the parent sees the pipe close
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
