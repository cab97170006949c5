"""The "math-verify" verifier: symbolic equivalence in killable worker processes
(docs/algorithm.md s1).

math-verify parses untrusted text into SymPy. Some inputs never finish (a power tower such as
``10^{10^{10^{10}}}`` hangs in the comparison; 5000 nested ``\\frac{`` hang the parser) and some
could eat memory. So every item runs in a ``reward.sandbox_pool.SandboxPool`` worker, with its
hard per-item timeout, address-space cap and dead-worker handling (see that module); what a
worker does with an item is ``reward.math_verify_worker.MathVerifyChecker``.
"""

from __future__ import annotations

from reward.math_verify_worker import MATH_VERIFY_TAIL_CHARS, MathVerifyChecker
from reward.sandbox_pool import (
    DEFAULT_MEMORY_LIMIT_BYTES,
    MAX_ITEM_RETRIES,
    SandboxPool,
    WorkerStartError,
)

__all__ = [
    "DEFAULT_MEMORY_LIMIT_BYTES",
    "MATH_VERIFY_TAIL_CHARS",
    "MAX_ITEM_RETRIES",
    "MathVerifyPool",
    "WorkerStartError",
]


class MathVerifyPool(SandboxPool):
    """A ``SandboxPool`` whose workers run math-verify (``label`` "math-verify")."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        *,
        memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
        start_timeout_s: float = 60.0,
    ) -> None:
        """Start ``workers`` processes (they import math-verify in the background).

        Args: as ``SandboxPool``; ``start_timeout_s`` bounds the import of math-verify.
        """
        super().__init__(
            MathVerifyChecker(),
            label="math-verify",
            workers=workers,
            timeout_s=timeout_s,
            memory_limit_bytes=memory_limit_bytes,
            start_timeout_s=start_timeout_s,
        )

    def __enter__(self) -> MathVerifyPool:
        return self
