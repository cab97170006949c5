"""What learner rank 0 tells every rank to do next, and the progress they all share.

Rank 0 decides one command per step boundary and shares it with the other ranks over the
learner's own process group; every rank then carries it out. Commands are small frozen values,
so what the ranks agree on is explicit and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.schemas import ScoredGroup


@dataclass(frozen=True)
class Progress:
    """The learner's step and policy version: held by the loop, passed to collaborators.

    `policy_version` only moves forward (a restore renumbers above anything published);
    `step` moves back only when an operator restores an earlier checkpoint.
    """

    step: int = 0
    policy_version: int = 0

    def next_step(self) -> Progress:
        return Progress(self.step + 1, self.policy_version)

    def next_policy(self) -> Progress:
        return Progress(self.step, self.policy_version + 1)


def resumed_policy_version(checkpoint_version: int, published_version: int) -> int:
    """The policy version to continue from after loading a checkpoint: the checkpoint's, unless
    a newer one was published since (replicas may hold it), then one above that."""
    return checkpoint_version if published_version <= checkpoint_version else published_version + 1


@dataclass(frozen=True)
class Picked:
    """A kept group taken from the train stream, with the stream entry that carried it."""

    entry_id: str
    group: ScoredGroup


@dataclass(frozen=True)
class Train:
    """Train one step on these groups (a full batch of `train_batch_groups`)."""

    picked: tuple[Picked, ...]

    @property
    def groups(self) -> list[ScoredGroup]:
        return [p.group for p in self.picked]


@dataclass(frozen=True)
class Wait:
    """Nothing to do yet (data still arriving, or Redis unreachable): come back next boundary."""


@dataclass(frozen=True)
class Pause:
    """An operator paused training: idle a moment, then ask again."""


@dataclass(frozen=True)
class SaveCheckpoint:
    """Write a checkpoint now; `keep` exempts it from retention."""

    keep: bool = False


@dataclass(frozen=True)
class Restore:
    """Load checkpoint `step` and publish its weights under a new policy version."""

    step: int


@dataclass(frozen=True)
class Stop:
    """Leave the loop: the run is complete, or the process was asked to stop."""


Command = Train | Wait | Pause | SaveCheckpoint | Restore | Stop
