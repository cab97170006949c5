"""Every sandbox test runs twice: with workers started by the stage's own process, and with
workers started by a sandbox host (`sandbox.host`) over its Unix socket, as in docker-compose and
Kubernetes, where the host is a container of its own. Each attack must fail both ways."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.host import SOCKET_ENV, SandboxHost


@pytest.fixture(params=["local", "host"], autouse=True)
def workers_from(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SandboxHost | None]:
    """The sandbox host the test's workers come from; None: local workers."""
    if request.param == "local":
        yield None
        return
    socket_path = str(Path(tmp_path_factory.mktemp("sandbox-host")) / "sandbox.sock")
    host = SandboxHost(socket_path)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SOCKET_ENV, socket_path)
        yield host
    host.stop()
    thread.join(5)
