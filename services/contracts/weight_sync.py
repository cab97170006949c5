"""The side process group that carries weights from learner rank 0 to rollout replicas.

Shared by the broadcaster (learner) and the receivers (rollout engines): how a group is formed
and how parameters are laid out in buckets. The group is independent of the learner's training
group: a TCPStore served by learner rank 0, a prefix per membership *generation*, and a
ProcessGroupGloo (CPU) or ProcessGroupNCCL (GPU) over it. Membership changes bump the
generation, and everyone builds a fresh group under the new prefix; a broken group is never
reused. Every operation has a timeout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Announcement:
    """One weight sync: who takes part, where to rendezvous, and what the buckets hold."""

    version: int
    generation: int
    members: tuple[str, ...]
    """Replica ids; replica i has rank i + 1 (the learner is rank 0)."""
    store_host: str
    store_port: int
    backend: str
    timeout_s: float
    buckets: tuple[tuple[ParamSpec, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.members) + 1

    @property
    def group_key(self) -> str:
        """Identity of the process group: a restarted learner serves a new store and counts
        generations from 1 again, so the generation number alone is not unique."""
        return f"{self.store_host}:{self.store_port}/gen{self.generation}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Announcement:
        buckets = tuple(
            tuple(ParamSpec(p["name"], tuple(p["shape"]), p["dtype"]) for p in bucket) for bucket in data["buckets"]
        )
        return cls(
            version=int(data["version"]), generation=int(data["generation"]), members=tuple(data["members"]),
            store_host=data["store_host"], store_port=int(data["store_port"]), backend=data["backend"],
            timeout_s=float(data["timeout_s"]), buckets=buckets,
        )


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_mb: int) -> tuple[tuple[ParamSpec, ...], ...]:
    """Group parameters (in order) into buckets of one dtype and at most ~bucket_mb each."""
    limit = bucket_mb * 2**20
    buckets: list[list[ParamSpec]] = []
    size = 0
    for name, t in named:
        dtype = str(t.dtype).removeprefix("torch.")
        nbytes = t.numel() * t.element_size()
        if not buckets or buckets[-1][0].dtype != dtype or (size + nbytes > limit and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(ParamSpec(name, tuple(t.shape), dtype))
        size += nbytes
    return tuple(tuple(b) for b in buckets)


def bucket_numel(bucket: tuple[ParamSpec, ...]) -> int:
    total = 0
    for p in bucket:
        n = 1
        for d in p.shape:
            n *= d
        total += n
    return total


def unflatten(flat: torch.Tensor, bucket: tuple[ParamSpec, ...]) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for p in bucket:
        n = 1
        for d in p.shape:
            n *= d
        out.append((p.name, flat[offset : offset + n].view(p.shape)))
        offset += n
    return out


def make_group(ann: Announcement, rank: int, *, is_master: bool = False) -> dist.ProcessGroup:
    """Rendezvous with the other members of `ann.generation` (blocks up to ann.timeout_s)."""
    timeout = timedelta(seconds=ann.timeout_s)
    store = dist.TCPStore(ann.store_host, ann.store_port, is_master=is_master, timeout=timeout, wait_for_workers=False)
    return make_group_on_store(store, ann, rank)


def make_group_on_store(store: dist.Store, ann: Announcement, rank: int) -> dist.ProcessGroup:
    timeout = timedelta(seconds=ann.timeout_s)
    prefixed = dist.PrefixStore(f"dapo-weights-{ann.group_key}", store)
    if ann.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, ann.world_size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, ann.world_size, timeout)


def broadcast_bucket(group: dist.ProcessGroup, flat: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([flat], opts)
    if not work.wait(timedelta(seconds=timeout_s)):
        raise TimeoutError(f"weight broadcast did not complete in {timeout_s}s")
