"""Functions that attack the sandbox from inside a worker (tests/sandbox/test_sandbox.py)."""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
import struct
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
    """Forks a child that would outlive the worker, writes its pid, then hangs."""
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    with open(args, "w") as f:
        f.write(str(pid))
    time.sleep(3600)
    return "never"


def echo(args: str) -> str:
    return args


def not_a_string(args: str) -> int:
    return 42


def environment(args: str) -> str:
    return " ".join(sorted(os.environ))


def working_directory(args: str) -> str:
    return os.getcwd()
