"""Reward functions for the `reward.function` tests: one that works, and ones that misbehave.

`answer_digit` is the one `tests/e2e/test_custom_reward.py` trains with: a response is right
when it contains the last digit of the ground truth, which a tiny model hits often but not
always, so groups keep a spread of rewards. Its scores (0.5 and -0.25) are not the built-in
verifiers' (+1 and -1), so a run's logged rewards show which function scored them, and its
`has_expression` metric shows whether the data row's `extra_info` reached it.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from reward import RewardOutput

RIGHT_SCORE = 0.5
WRONG_SCORE = -0.25


def answer_digit(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    """Right when the response contains the ground truth's last digit."""
    digit = ground_truth.strip()[-1:]
    acc = bool(digit) and digit in response
    return RewardOutput(
        score=RIGHT_SCORE if acc else WRONG_SCORE,
        acc=acc,
        pred=digit if acc else "",
        metrics={
            "response_chars": float(len(response)),
            # The synthetic task's rows carry the sum in extra_info: 1.0 shows it arrived.
            "has_expression": float("expression" in extra_info),
        },
    )


def weighted_by_extra_info(
    response: str, ground_truth: str, extra_info: dict[str, Any]
) -> dict[str, Any]:
    """A dict result whose score comes from the row's extra_info."""
    acc = response.strip() == ground_truth
    return {"score": float(extra_info.get("weight", 0.0)) if acc else 0.0, "acc": acc}


def raises(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    raise ValueError(f"cannot score {response!r}")


def hangs(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    if response == "hang":
        time.sleep(3600)
    return RewardOutput(score=1.0, acc=True)


def exits(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    os._exit(3)


def returns_text(response: str, ground_truth: str, extra_info: dict[str, Any]) -> str:
    return "yes"


def returns_nan(response: str, ground_truth: str, extra_info: dict[str, Any]) -> dict[str, Any]:
    return {"score": float("nan"), "acc": False}


def returns_unknown_key(
    response: str, ground_truth: str, extra_info: dict[str, Any]
) -> dict[str, Any]:
    return {"score": 1.0, "acc": True, "bonus": 2}


def returns_int_acc(response: str, ground_truth: str, extra_info: dict[str, Any]) -> dict[str, Any]:
    return {"score": 1.0, "acc": 1}


def two_arguments(response: str, ground_truth: str) -> RewardOutput:
    return RewardOutput(score=1.0, acc=True)


async def asynchronous(
    response: str, ground_truth: str, extra_info: dict[str, Any]
) -> RewardOutput:
    await asyncio.sleep(0)
    return RewardOutput(score=1.0, acc=True)


NOT_CALLABLE = 42


# -- hostile: code that attacks the reward service from inside its worker --


def _write_on_pipes(data: bytes) -> None:
    """Write raw bytes on every pipe above stderr: the worker's pipe to the reward service."""
    import contextlib
    import os
    import stat

    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd") if int(name) > 2):
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, data)


class _RunsACommand:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {os.environ.get('DAPO_PWNED_MARKER', '/tmp/dapo-pwned')}",))


def sends_a_pickle(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    """A whole message whose body is a pickle that runs a command if the parent unpickles it."""
    import pickle
    import struct
    import time

    body = pickle.dumps(_RunsACommand())
    _write_on_pipes(struct.pack(">I", len(body)) + body)
    time.sleep(60)
    return RewardOutput(score=1.0, acc=True)


def sends_half_a_message(
    response: str, ground_truth: str, extra_info: dict[str, Any]
) -> RewardOutput:
    """A header promising 1,000 bytes, then nothing: the parent must not wait for the rest."""
    import struct
    import time

    _write_on_pipes(struct.pack(">I", 1000))
    time.sleep(60)
    return RewardOutput(score=1.0, acc=True)


def forks(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    import os

    os.fork()
    return RewardOutput(score=1.0, acc=True)


def reads_secrets(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    import os

    leaked = sorted(k for k in os.environ if k not in ("PATH", "HOME", "TMPDIR", "LANG"))
    # The process's own environment block too (what /proc/self/environ shows): a worker that
    # only cleared os.environ kept the service's secrets there.
    with open("/proc/self/environ", "rb") as f:
        block = f.read().decode(errors="replace")
    leaked += ["environ-block"] if "hunter2" in block or "WANDB_API_KEY" in block else []
    return RewardOutput(score=1.0, acc=not leaked, pred=",".join(leaked))


def connects_to_redis(response: str, ground_truth: str, extra_info: dict[str, Any]) -> RewardOutput:
    """A TCP connection to the port in the ground truth, through libc (past any audit hook)."""
    import ctypes
    import socket
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
    if fd < 0:
        return RewardOutput(score=0.0, acc=False, pred=f"socket refused {ctypes.get_errno()}")
    address = struct.pack("<HH4s8x", 2, socket.htons(int(ground_truth)), bytes([127, 0, 0, 1]))
    done = libc.connect(fd, address, len(address))
    return RewardOutput(score=0.0, acc=done == 0, pred=f"connect {done}")
