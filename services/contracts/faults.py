"""Deliberate slowness for the fault suite: make a stage N times slower than it really is.

Read once from the `DAPO_FAULTS` environment variable, a comma-separated list of `name=factor`:

    DAPO_FAULTS="learner.slowdown=10"   every training step takes 10x its real time
    DAPO_FAULTS="rollout.slowdown=10"   every generation batch takes 10x its real time

This is how the back-pressure scenarios get "a learner 10x slower than rollout" without a
different model or machine: after the real work the stage sleeps (factor - 1) x its duration.
Unset (always, outside tests) it costs one dict lookup.
"""

from __future__ import annotations

import os
import threading
import time

KNOWN = ("learner.slowdown", "rollout.slowdown")


def _parse(spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in KNOWN:
            raise ValueError(f"DAPO_FAULTS: unknown item {item!r} (known: {', '.join(KNOWN)}, as name=factor)")
        factor = float(value)
        if factor < 1:
            raise ValueError(f"DAPO_FAULTS: {name} must be >= 1, got {value}")
        out[name] = factor
    return out


FAULTS = _parse(os.environ.get("DAPO_FAULTS", ""))


def stretch(name: str, seconds: float, stop: threading.Event | None = None) -> None:
    """Sleep so that work that took `seconds` appears to take `factor` times as long."""
    factor = FAULTS.get(name, 1.0)
    if factor > 1.0:
        delay = (factor - 1.0) * seconds
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)
