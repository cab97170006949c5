"""User tool functions for the tool-use tests (`rollout.tools.functions: ["...:hang"]`)."""

from __future__ import annotations

import os
import time


def hang(args: str) -> str:
    while True:
        time.sleep(1)


def crash(args: str) -> str:
    os._exit(7)  # the worker dies mid-call, as a segfaulting extension would


def spawn(args: str) -> str:
    """Forks a grandchild that outlives nothing: the sandbox refuses to start processes."""
    os.fork()
    return "forked"


def secret(args: str) -> str:
    return ",".join(sorted(k for k in os.environ if "KEY" in k or "REDIS" in k)) or "none"
