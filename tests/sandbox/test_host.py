"""The sandbox host's relay (`sandbox/host.py`), spoken to as a hostile or impatient caller."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.frames import encode
from sandbox.host import SandboxHost, peer_uid


@pytest.fixture
def host(workers_from: SandboxHost | None, tmp_path: Path) -> Iterator[SandboxHost]:
    """The suite's sandbox host where its tests use one, else one of this test's own."""
    if workers_from is not None:
        yield workers_from
        return
    own = SandboxHost(str(tmp_path / "sandbox.sock"))
    thread = threading.Thread(target=own.serve_forever, daemon=True)
    thread.start()
    yield own
    own.stop()
    thread.join(5)


def test_a_caller_that_gives_up_on_a_stalled_worker_gets_it_killed(host: SandboxHost) -> None:
    """The worker stops reading its stdin (it hangs while loading) while the caller sends more
    than the pipe holds, then closes: the relay must not block on the stalled pipe, so it sees
    the caller go and kills the worker."""
    hello = {
        "function": "tests.sandbox.hostile:hang_at_load",
        "paths": [str(Path(__file__).resolve().parents[2])],
        "factory_args": "",
    }
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    caller.settimeout(10)  # a relay that stops reading fails the test, not hangs it
    caller.connect(host.socket_path)
    caller.sendall(encode(hello))
    deadline = time.monotonic() + 10
    while not host.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host.pids(), "no worker started"
    caller.sendall(encode({"args": "x" * 500_000, "id": "1"}) * 2)  # 1 MB: past the pipe
    caller.close()
    deadline = time.monotonic() + 10
    while host.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host.pids() == [], "the stalled worker outlived its caller"


def _call(path: str) -> bytes:
    """Connect and send a worker's hello; what comes back (b"": closed without a frame)."""
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    caller.settimeout(10)
    try:
        caller.connect(path)
        caller.sendall(encode({"function": "json:dumps", "paths": [], "factory_args": ""}))
        return caller.recv(1)
    except (BrokenPipeError, ConnectionResetError):  # closed before or after the hello
        return b""
    finally:
        caller.close()


def _call_as(uid: int, path: str) -> bytes:
    """`_call` from a child process that dropped to `uid` (needs root)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: socket calls only, then out
        os.close(read)
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, b"+" + _call(path))
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer.startswith(b"+"), "the child could not call"
    return answer[1:]


def test_a_caller_of_a_uid_the_host_does_not_serve_is_refused_before_a_worker_starts() -> None:
    """The kernel names the caller's uid (SO_PEERCRED). A host serving another uid closes the
    connection at once, with no frame and no worker: a caller of a third uid is counted (and
    logged); one of the host's own uid, its container's health probe, is not. By default a host
    serves its own uid."""
    a, b = socket.socketpair(socket.AF_UNIX)
    assert peer_uid(a) == os.getuid()
    a.close()
    b.close()
    socket_dir = Path(tempfile.mkdtemp())
    socket_dir.chmod(0o755)  # another uid may enter, as a stage does
    own = SandboxHost(str(socket_dir / "own.sock"))
    assert own.allowed_uids == {os.getuid()}
    own.stop()
    host = SandboxHost(str(socket_dir / "sandbox.sock"), allowed_uids=frozenset({os.getuid() + 1}))
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    try:
        assert _call(host.socket_path) == b""  # the health probe: closed, not counted
        assert host.refused_uids == 0 and host.pids() == []
        if os.getuid() != 0:
            pytest.skip("calling as a third uid needs root")
        assert _call_as(65534, host.socket_path) == b""
        assert host.refused_uids == 1 and host.pids() == []
    finally:
        host.stop()
        thread.join(5)
        shutil.rmtree(socket_dir, ignore_errors=True)
