"""Functions that attack the sandbox from inside a worker (tests/sandbox/test_sandbox.py)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import pickle
import signal
import socket
import stat
import struct
import sys
import threading
import time


def _frame_pipes() -> list[int]:
    """The worker's pipes above stderr: its private copy of stdout, where replies go."""
    fds = []
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd") if int(name) > 2):
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                fds.append(fd)
    return fds


def _send_raw(data: bytes) -> None:
    for fd in _frame_pipes():
        with contextlib.suppress(OSError):
            os.write(fd, data)


def half_frame(args: str) -> str:
    """A header promising 100 bytes, then nothing."""
    _send_raw(struct.pack(">I", 100))
    time.sleep(3600)
    return "never"


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {os.environ.get('HOME', '/tmp')}/pwned",))


def pickled(args: str) -> str:
    """A whole frame whose body is a pickle that would run a command if unpickled."""
    body = pickle.dumps(_Boom())
    _send_raw(struct.pack(">I", len(body)) + body)
    time.sleep(3600)
    return "never"


def deep_json(args: str) -> str:
    body = b"[" * 5000 + b"]" * 5000
    _send_raw(struct.pack(">I", len(body)) + body)
    time.sleep(3600)
    return "never"


def oversized(args: str) -> str:
    _send_raw(struct.pack(">I", 1 << 31))
    time.sleep(3600)
    return "never"


def grandchild(args: str) -> str:
    """Forks a child that would outlive the worker, then hangs."""
    if os.fork() == 0:
        time.sleep(3600)
        os._exit(0)
    time.sleep(3600)
    return "never"


# --- what code in a worker tries against the services (tests/sandbox/test_confinement.py) -----
_libc = ctypes.CDLL(None, use_errno=True)


def _errno_text(result: int) -> str:
    return f"ok {result}" if result >= 0 else f"refused {errno.errorcode[ctypes.get_errno()]}"


def read_file(path: str) -> str:
    """The first bytes of `path`: a Redis configuration, another process's environ."""
    try:
        with open(path, "rb") as f:
            return "read " + f.read(200).decode(errors="replace")
    except OSError as exc:
        return f"refused {type(exc).__name__}"


def write_file(path: str) -> str:
    """A .pth file in the user's venv, a file beside the run."""
    try:
        with open(path, "w") as f:
            f.write("import os; os.system('touch /tmp/pwned')\n")
        return "wrote"
    except OSError as exc:
        return f"refused {type(exc).__name__}"


def libc_kill(pid: str) -> str:
    """SIGKILL to a process of the same uid, through libc (past any audit hook)."""
    return _errno_text(_libc.kill(int(pid), signal.SIGKILL))


def libc_fork(args: str) -> str:
    """fork() through libc, then setsid() in the child: a process the group kill would miss."""
    pid = _libc.fork()
    if pid == 0:
        _libc.setsid()
        time.sleep(3600)
        os._exit(0)
    return _errno_text(pid)


def libc_connect(port: str) -> str:
    """A TCP connect to 127.0.0.1:port through libc (the run's Redis)."""
    fd = _libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
    if fd < 0:
        return "socket " + _errno_text(fd)
    address = struct.pack("<HH4s8x", 2, socket.htons(int(port)), bytes([127, 0, 0, 1]))
    return "connect " + _errno_text(_libc.connect(fd, address, len(address)))


def libc_execve(args: str) -> str:
    """exec a shell through libc."""
    argv = (ctypes.c_char_p * 2)(b"/bin/sh", None)
    return _errno_text(_libc.execve(b"/bin/sh", argv, None))


def ptrace_attach(pid: str) -> str:
    return _errno_text(_libc.ptrace(16, int(pid), None, None))  # PTRACE_ATTACH


def forge_next_reply(args: str) -> str:
    """Answers this call, then writes a reply for the next call on the pipe, as if it came from
    the worker: the next call must not return the forged text."""

    # The worker's loop holds this call's request in a local: read its id off the stack and guess
    # the next one (a counter's successor).
    frame, current = sys._getframe(1), None
    while frame is not None and current is None:
        current = frame.f_locals.get("request", {}).get("id")
        frame = frame.f_back
    guess = current + 1 if isinstance(current, int) else current

    def later() -> None:
        time.sleep(0.2)
        for fd in _frame_pipes():
            body = json.dumps({"ok": True, "value": "forged", "id": guess}).encode()
            with contextlib.suppress(OSError):
                os.write(fd, struct.pack(">I", len(body)) + body)

    threading.Thread(target=later).start()
    return "honest"


def echo(args: str) -> str:
    return args


def not_a_string(args: str) -> int:
    return 42


def environment(args: str) -> str:
    return " ".join(sorted(os.environ))


def working_directory(args: str) -> str:
    return os.getcwd()


def hang_at_load(args: str) -> object:
    """A factory that never returns: the worker stops reading its stdin while loading."""
    time.sleep(3600)
    return echo
