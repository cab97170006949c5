"""The sandbox host's relay (`sandbox/host.py`), spoken to as a hostile or impatient caller."""

from __future__ import annotations

import os
import socket
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


def test_a_caller_of_a_uid_the_host_does_not_serve_is_refused_before_a_worker_starts(
    tmp_path: Path,
) -> None:
    """The kernel names the caller's uid (SO_PEERCRED): a host told to serve another uid closes
    the connection at once, starts no worker and counts the refusal; by default it serves its
    own uid, and the peer it names is this process's."""
    own = SandboxHost(str(tmp_path / "own.sock"))
    assert own.allowed_uids == {os.getuid()}
    own.stop()
    host = SandboxHost(str(tmp_path / "sandbox.sock"), allowed_uids=frozenset({os.getuid() + 1}))
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    try:
        caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        caller.settimeout(10)
        caller.connect(host.socket_path)
        try:
            caller.sendall(encode({"function": "json:dumps", "paths": [], "factory_args": ""}))
            answer = caller.recv(1)
        except (BrokenPipeError, ConnectionResetError):  # closed before or after the hello
            answer = b""
        assert answer == b""  # closed, no frame
        assert host.refused == 1 and host.pids() == []
        a, b = socket.socketpair(socket.AF_UNIX)
        assert peer_uid(a) == os.getuid()
        a.close(), b.close()
    finally:
        host.stop()
        thread.join(5)
