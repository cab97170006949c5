"""Publishing weights to the rollout replicas, as the loop sees it.

Rank 0 holds a `learner.weight_publisher.WeightPublisher`; the other ranks hold the null
publisher, which only takes part in gathering the full parameters (a collective) and keeps
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

NamedTensors = Iterable[tuple[str, Tensor]]


@dataclass(frozen=True)
class Publication:
    """What one publication of the staged weights moved: the step's `weight_sync/*` metrics.

    `nbytes` is one copy of the payload, what each replica received: the full weights, or with
    LoRA the adapters alone, in the serving dtype. It is per replica, not multiplied by
    `replicas` (rank 0 sends one copy into the broadcast; the replicas together received
    nbytes x replicas). `seconds` is the publication's wall time, from reading the live replicas
    to the last bucket sent, a failed join's wait and the re-formed group's included; the loop
    reports it as `timing_s/sync_weights` too. With no replica registered, or nothing staged,
    it moves 0 bytes to 0 replicas (its seconds are the look-up's). A publication that reached
    no replica (the broadcast raised, or no chosen replica joined) reports the seconds it cost,
    0 bytes, 0 replicas and `failed`: a replica that received part of it discards it and is
    caught up later.
    """

    seconds: float = 0.0
    nbytes: int = 0
    replicas: int = 0
    failed: bool = False

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync/seconds": self.seconds,
            "weight_sync/bytes": float(self.nbytes),
            "weight_sync/replicas": float(self.replicas),
            "weight_sync/failed": float(self.failed),
        }


class Publisher(Protocol):
    last_publication: Publication
    """The last `publish()`'s (each step's); catching a replica up does not replace it."""

    def stage(
        self, policy_version: int, named_iter: NamedTensors, layout: list[tuple[str, Any]], /
    ) -> None: ...

    def publish(self) -> bool: ...

    def catch_up(self) -> None: ...

    def staged(self) -> Iterator[tuple[str, Tensor]]: ...


class NullPublisher:
    """Ranks other than 0: gather (every rank must), keep nothing, send nothing."""

    last_publication = Publication()  # sends nothing

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
