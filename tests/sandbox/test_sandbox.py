"""The sandbox (sandbox/pool.py) contains what its workers do: a call that hangs, crashes, sends
half a frame, a pickle, nested JSON or an oversize header ends as an error result at its
deadline, never blocks or runs code in the parent; the worker's process group dies with it; the
environment carries no secret; network and new processes are refused."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sandbox.builtin_tools import calculator
from sandbox.host import SandboxHost
from sandbox.pool import Sandbox, SandboxStartError

HOSTILE = "tests.sandbox.hostile"


def test_the_calculator_is_exact_and_refuses_anything_but_arithmetic() -> None:
    assert calculator("12*34") == "408"
    assert calculator("7/2") == "3.5"
    assert calculator("6/3") == "2"
    assert calculator("-(2**100)") == str(-(2**100))
    for bad in ("__import__('os')", "2**100000", "1/0", "x+1", "[1]*9"):
        with pytest.raises(ValueError):
            calculator(bad)


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        ("half_frame", "ran past its 1 s limit"),
        ("pickled", "bad reply (a frame that is not JSON"),
        ("deep_json", "bad reply (a frame that is not JSON (RecursionError)"),
        ("oversized", "over the 1048576-byte limit"),
        ("not_a_string", "returned a int, not a str"),
    ],
)
def test_a_hostile_reply_is_an_error_result_at_the_deadline(
    tmp_path: Path, function: str, reason: str
) -> None:
    with Sandbox(f"{HOSTILE}:{function}", workers=1, timeout_s=1.0) as box:
        started = time.monotonic()
        result = box.call("x")
        assert time.monotonic() - started < 5
        assert not result.ok and reason in result.text, result.text
        # A worker that broke the protocol was replaced; one that merely failed its call stays.
        assert box.restarts == (0 if function == "not_a_string" else 1)
    assert not (Path.home() / "pwned").exists()


def _in_session(session: int) -> list[int]:
    """The processes whose session is `session` (a worker leads its own)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == session:
                out.append(int(entry.name))
    return out


def test_a_timeout_kills_what_the_worker_forked(workers_from: SandboxHost | None) -> None:
    with Sandbox(f"{HOSTILE}:grandchild", workers=1, timeout_s=1.0, allow_processes=True) as box:
        worker = box.pids()[0] if workers_from is None else workers_from.pids()[0]
        assert worker is not None
        result = box.call("")
        assert result.timed_out and box.timeouts == 1 and box.restarts == 1
        deadline = time.monotonic() + 5
        while _in_session(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _in_session(worker), "the forked grandchild survived its worker's kill"


def test_workers_see_no_secret_and_no_network_and_start_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DAPO_REDIS_URL", "redis://:hunter2@redis:6379/0")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    with Sandbox(f"{HOSTILE}:environment", workers=1) as box:
        assert box.call("").text.split() == ["HOME", "LANG", "PATH", "TMPDIR"]
    with Sandbox(f"{HOSTILE}:working_directory", workers=1) as box:
        cwd = box.call("").text
        assert cwd != os.getcwd() and "dapo-sandbox-" in cwd
    with Sandbox("sandbox.builtin_tools:python", workers=1) as box:
        net, proc, ok = box.call_many(
            [
                "import socket; socket.create_connection(('127.0.0.1', 6379))",
                "import subprocess; subprocess.run(['true'])",
                "print(sum(range(10)))",
            ]
        )
    assert "network access is not allowed" in net.text
    assert "starting processes is not allowed" in proc.text
    assert ok.ok and ok.text == "45\n"


def test_memory_past_the_limit_fails_the_call_not_the_pool() -> None:
    with Sandbox("sandbox.builtin_tools:python", workers=1, memory_bytes=256 << 20) as box:
        big, after = box.call_many(["b = bytearray(1 << 30)", "1 + 1"])
    assert not big.ok and "MemoryError" in big.text
    assert after.ok and after.text == "2\n"


def test_calls_run_concurrently_on_the_workers() -> None:
    """Each call reports when it ran: all four intervals overlap, on four different workers."""
    code = "import os, time; a = time.time(); time.sleep(0.5); (os.getpid(), a, time.time())"
    with Sandbox("sandbox.builtin_tools:python", workers=4) as box:
        results = box.call_many([code] * 4)
    spans = [tuple(float(x) for x in r.text.strip("()\n").split(", ")) for r in results]
    assert len({pid for pid, _, _ in spans}) == 4
    assert max(start for _, start, _ in spans) < min(end for _, _, end in spans)


def test_a_function_that_cannot_be_loaded_fails_at_start_naming_it() -> None:
    loaded = r"tests\.sandbox\.hostile:nope could not be loaded"
    with pytest.raises(SandboxStartError, match=loaded):
        Sandbox(f"{HOSTILE}:nope", workers=1)
    with pytest.raises(SandboxStartError, match="No module named 'no_such_module'"):
        Sandbox("no_such_module:fn", workers=1)


def test_each_call_has_a_cpu_time_budget_of_its_wall_clock_limit() -> None:
    """RLIMIT_CPU is moved before every call to what the worker used so far plus the call's
    limit: CPU burnt past it ends the worker (the kernel's SIGXCPU), whatever the wall clock."""
    probe = (
        "import resource\n"
        "u = resource.getrusage(resource.RUSAGE_SELF)\n"
        "soft = resource.getrlimit(resource.RLIMIT_CPU)[0]\n"
        "soft - (u.ru_utime + u.ru_stime)"
    )
    with Sandbox("sandbox.builtin_tools:python", workers=1, timeout_s=3.0) as box:
        first, second = box.call_many([probe, "sum(i * i for i in range(10**6))\n" + probe])
    for result in (first, second):
        assert result.ok, result
        assert 3.0 <= float(result.text) <= 4.5  # the budget left: 3 s, rounded up to a second


def test_a_call_larger_than_the_pipe_buffer_is_written_whole() -> None:
    """A frame of 300 KB is several pipe buffers: the parent waits for the worker to drain the
    pipe (until the call's deadline) instead of failing on a full one."""
    big = "x" * 300_000
    with Sandbox(f"{HOSTILE}:echo", workers=1, max_args_chars=len(big)) as box:
        result = box.call(big)
    assert result.ok and result.text == big[:4096]  # the reply is cut to max_result_chars
    assert box.restarts == 0
