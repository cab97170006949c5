"""Deliberate slowness for the fault suite: make a stage N times slower than it really is.

Read once from the `DAPO_FAULTS` environment variable, a comma-separated list of `name=factor`:

    DAPO_FAULTS="learner.slowdown=10"   every training step takes 10x its real time
    DAPO_FAULTS="rollout.slowdown=10"   every decode step of a generation takes 10x its real time

This is how the back-pressure scenarios get "a learner 10x slower than rollout" without a
different model or machine: after the real work the stage sleeps (factor - 1) x its duration.
A rollout replica sleeps after each decode step, and takes an in-flight weight update announced
during that sleep at once: a slow model is emulated as one with more decode steps, each as
interruptible as a real one. Unset (always, outside tests) `slowdown` returns None and the
stages' hot paths hold no hook at all.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

KNOWN = ("learner.slowdown", "rollout.slowdown")


def _parse(spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in KNOWN:
            raise ValueError(
                f"DAPO_FAULTS: unknown item {item!r} (known: {', '.join(KNOWN)}, as name=factor)"
            )
        factor = float(value)
        if factor < 1:
            raise ValueError(f"DAPO_FAULTS: {name} must be >= 1, got {value}")
        out[name] = factor
    return out


FAULTS = _parse(os.environ.get("DAPO_FAULTS", ""))


class Slowdown:
    """Work stretched to `factor` times its real duration (a stage of the fault suite)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def after(
        self,
        seconds: float,
        stop: threading.Event | None = None,
        *,
        wake: threading.Event | None = None,
        on_wake: Callable[[], object] | None = None,
    ) -> None:
        """Sleep so that work that took `seconds` appears to take `factor` times as long; when
        `wake` is set meanwhile, call `on_wake()` at once and sleep on (a decode step ends early
        to take a weight update, as a real one would after at most one step)."""
        deadline = time.monotonic() + (self.factor - 1.0) * seconds
        while (left := deadline - time.monotonic()) > 0:
            if stop is not None and stop.is_set():
                return
            if wake is None:
                (stop.wait if stop is not None else time.sleep)(left)
                continue
            if wake.wait(left) and on_wake is not None:
                on_wake()


def slowdown(name: str) -> Slowdown | None:
    """The slowdown the fault suite set for `name` in `DAPO_FAULTS`; None otherwise (always,
    outside the fault suite), so that a stage leaves the hook out of its hot path altogether."""
    if name not in KNOWN:
        raise ValueError(f"unknown fault {name!r} (known: {', '.join(KNOWN)})")
    factor = FAULTS.get(name, 1.0)
    return Slowdown(factor) if factor > 1.0 else None
