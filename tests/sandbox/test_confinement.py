"""Code in a sandbox worker (a tool the model called, a user's reward function) attacks the run
for real, through libc where an audit hook would stop Python: each attack fails, under both
kernel layers together and under each layer alone where that layer is the one meant to stop it
(`sandbox.confine`). The worker shares this process's uid here, as in a pod with one user.

Each test also checks that the thing attacked is within reach of an unconfined process of this
uid (the test itself), so a pass means the sandbox stopped it, not that nothing was there."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.confine import UNCONFINED_ENV, landlock_abi
from sandbox.pool import Sandbox, SandboxStartError

HOSTILE = "tests.sandbox.hostile"
REPO = Path(__file__).resolve().parents[2]
BOTH = ("landlock", "seccomp")

needs_landlock = pytest.mark.skipif(landlock_abi() < 6, reason="Landlock ABI 6 (kernel 6.12+)")


def _seccomp_loads() -> bool:
    try:
        import pyseccomp  # noqa: F401

        return True
    except (ImportError, OSError):
        return False


needs_seccomp = pytest.mark.skipif(not _seccomp_loads(), reason="libseccomp is not installed")


def call(function: str, args: str, layers: tuple[str, ...] = BOTH) -> str:
    with Sandbox(f"{HOSTILE}:{function}", workers=1, timeout_s=5.0, layers=layers) as box:
        result = box.call(args)
    assert result.ok, result.text
    return result.text


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this uid holding a secret in its environment, as a service does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, "DAPO_REDIS_URL": "redis://learner:hunter2@127.0.0.1:6379/0"},
    )
    time.sleep(0.2)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def run_config() -> Iterator[Path]:
    """A run's Redis configuration where `dapo run` writes it: under the project root, which
    is on the worker's import path."""
    path = REPO / "runs" / f"confinement-test-{os.getpid()}" / "redis" / "redis.conf"
    path.parent.mkdir(parents=True)
    path.write_text("requirepass hunter2\n")
    yield path
    path.unlink()
    path.parent.rmdir()
    path.parent.parent.rmdir()


@needs_landlock
@needs_seccomp
def test_the_workers_here_get_both_layers() -> None:
    with Sandbox(f"{HOSTILE}:echo", workers=1) as box:
        assert box.confinement is not None
        assert box.confinement.landlock_abi >= 6 and box.confinement.seccomp
        assert box.confinement.no_new_privs and not box.confinement.errors


@needs_landlock
@pytest.mark.parametrize("layers", [BOTH, ("landlock",)])
def test_no_file_outside_the_package_path_is_read_nor_written(
    layers: tuple[str, ...],
    victim: subprocess.Popen[bytes],
    run_config: Path,
    tmp_path: Path,
) -> None:
    environ = f"/proc/{victim.pid}/environ"
    assert b"hunter2" in Path(environ).read_bytes()  # within this uid's reach, unconfined
    assert call("read_file", environ, layers).startswith("refused")
    assert call("read_file", str(run_config), layers).startswith("refused")
    assert call("read_file", str(REPO / "sandbox" / "pool.py"), layers).startswith("read")
    pth = Path(sysconfig.get_paths()["purelib"]) / f"zz-confinement-{os.getpid()}.pth"
    assert call("write_file", str(pth), layers).startswith("refused") and not pth.exists()
    beside = run_config.parent / "planted"
    assert call("write_file", str(beside), layers).startswith("refused") and not beside.exists()
    assert call("write_file", "planted-in-home", layers) == "wrote"  # its private directory


@needs_landlock
@needs_seccomp
@pytest.mark.parametrize("layers", [BOTH, ("landlock",), ("seccomp",)])
def test_no_signal_reaches_a_service_and_nothing_is_traced(
    layers: tuple[str, ...], victim: subprocess.Popen[bytes]
) -> None:
    assert call("libc_kill", str(victim.pid), layers).startswith("refused")
    assert call("ptrace_attach", str(victim.pid), layers).startswith("refused")
    time.sleep(0.1)
    assert victim.poll() is None  # alive


@needs_landlock
@needs_seccomp
@pytest.mark.parametrize("layers", [BOTH, ("landlock",), ("seccomp",)])
def test_no_tcp_connection_and_no_program_is_run(layers: tuple[str, ...]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            pass  # reachable from this process
        assert "refused" in call("libc_connect", str(port), layers)
    assert call("libc_execve", "", layers).startswith("refused")


@needs_seccomp
def test_no_process_is_forked_that_could_outlive_the_worker() -> None:
    assert call("libc_fork", "", ("seccomp",)) == "refused EPERM"
    with Sandbox("sandbox.builtin_tools:python", workers=1) as box:
        threads = box.call(
            "import threading\nout = []\nt = threading.Thread(target=out.append, args=(1,))\n"
            "t.start(); t.join(); out"
        )
    assert threads.ok and threads.text == "[1]\n"  # threads still work


def test_a_reply_forged_for_the_next_call_is_not_taken_for_it() -> None:
    with Sandbox(f"{HOSTILE}:forge_next_reply", workers=1, timeout_s=5.0) as box:
        assert box.call("").text == "honest"
        time.sleep(0.5)  # the forged frame is on the pipe now
        second = box.call("")
        assert second.text != "forged" and "bad reply" in second.text
        assert box.restarts == 1  # the worker that forged it was replaced
        assert box.call("").text == "honest"


def test_a_worker_with_neither_layer_runs_only_when_the_operator_opts_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNCONFINED_ENV, raising=False)
    with pytest.raises(SandboxStartError, match=f"neither Landlock nor seccomp.*{UNCONFINED_ENV}"):
        Sandbox(f"{HOSTILE}:echo", workers=1, layers=())
    monkeypatch.setenv(UNCONFINED_ENV, "1")
    with Sandbox(f"{HOSTILE}:echo", workers=1, layers=()) as box:
        assert box.call("x").text == "x"


def test_services_are_not_dumpable_so_their_environ_is_closed_to_their_uid() -> None:
    """Every `dapo` command makes itself non-dumpable at start: the kernel then gives its
    /proc/<pid>/environ, memory and descriptors to root, not to its uid."""
    probe = (
        "import services.cli as cli, sandbox.confine as c\n"
        "print(c.is_dumpable(), end=' ')\n"
        "cli.main(['model', 'list'])\n"
        "print(c.is_dumpable())"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.split()[0] == "True" and done.stdout.split()[-1] == "False", done.stdout
