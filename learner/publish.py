"""Publishing weights to the rollout replicas, as the loop sees it.

Rank 0 holds a `learner.weight_publisher.WeightPublisher`; the other ranks hold the null
publisher, which only takes part in gathering the full parameters (a collective) and keeps
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from torch import Tensor

NamedTensors = Iterable[tuple[str, Tensor]]


class Publisher(Protocol):
    last_sync_s: float

    def stage(
        self, policy_version: int, named_iter: NamedTensors, layout: list[tuple[str, Any]], /
    ) -> None: ...

    def publish(self) -> bool: ...

    def catch_up(self) -> None: ...

    def staged(self) -> Iterator[tuple[str, Tensor]]: ...


class NullPublisher:
    """Ranks other than 0: gather (every rank must), keep nothing, send nothing."""

    last_sync_s = 0.0

    def stage(
        self, policy_version: int, named_iter: NamedTensors, layout: list[tuple[str, Any]]
    ) -> None:
        for _ in named_iter:
            pass

    def publish(self) -> bool:
        return True

    def catch_up(self) -> None:
        pass

    def staged(self) -> Iterator[tuple[str, Tensor]]:
        return iter(())
