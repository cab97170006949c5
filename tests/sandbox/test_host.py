"""The sandbox host's relay (`sandbox/host.py`), spoken to as a hostile or impatient caller."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.frames import encode
from sandbox.host import SandboxHost


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
