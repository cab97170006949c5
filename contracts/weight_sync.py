"""The side process group that carries weights from learner rank 0 to rollout replicas.

Why a side group: the replicas are not part of the learner's training group (they come and go,
and a hung one must not stall training), so weights travel over a group of their own. A
TCPStore served by learner rank 0, a prefix per membership *epoch*, and a ProcessGroupGloo (CPU)
or ProcessGroupNCCL (GPU) over it. A membership change bumps the epoch and everyone builds a
fresh group under the new prefix; a broken group is never reused. Every operation has a timeout.

Parameters travel in buckets: consecutive tensors of one dtype flattened into one buffer of
about `learner.weight_bucket_mb`, so a sync is a few large broadcasts instead of one per tensor.

`WeightChannel` is the Redis half of the conversation (announcements, the join set, the go/abort
decision); the learner's publisher (`learner.weight_publisher`) and the replica's receiver
(`rollout.weight_receiver`) each hold one and own their side of the protocol.

Only the learner can announce: every announcement and every go/abort decision carries an
Ed25519 signature under the run's weight-sync private key (`DAPO_WEIGHTS_KEY`, held by the
learner alone); the replicas hold the public key (`DAPO_WEIGHTS_PUBLIC_KEY`), which verifies and
cannot sign. So neither a pod that has a Redis password nor a replica itself (a compromised
one, with every secret it holds) can make a replica join a rendezvous of its choosing. A replica
also checks what a signed announcement asks before it allocates anything: the version, epoch,
port and time-out in range, the host the one it was told to expect (`DAPO_WEIGHTS_HOST`, where
set), dtypes from `DTYPES` only, and every bucket's names and shapes those of its own model
(`check_buckets`).

`WeightStream` is what an engine receives: a small picklable description of one sync (the
announcement and this replica's rank). Iterating it joins (or reuses) the receive group of the
process that iterates it and yields `(name, tensor)` bucket by bucket, so the same object works
in the rollout process (transformers engine) and inside vLLM's worker process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from contracts.config import ConfigError
from contracts.signing import WeightKey, sign, signature_holds

if TYPE_CHECKING:
    from contracts.bus.hygiene import RedisHygiene

log = logging.getLogger(__name__)

# torch.distributed exports these at run time; its stubs do not list them.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Every dtype weights travel in; an announcement naming another is refused."""

HOST_ENV = "DAPO_WEIGHTS_HOST"
"""The learner's weight-sync host: where it listens, and the one host a replica accepts in an
announcement (`dapo run` pins it for the replicas it starts)."""
PORT_ENV = "DAPO_WEIGHTS_PORT"
"""The port of the learner's weight-sync store (unset or 0: any free port). Kubernetes fixes it,
so a NetworkPolicy can open it, and only it beside the collectives' ports, to the replicas."""
MAX_VERSION = 2**31 - 1
"""Policy versions and membership epochs above this are refused (a step a second for 68
years)."""
MAX_TIMEOUT_S = 24 * 3600.0
MAX_REPLICAS = 4096
MAX_NAME_CHARS = 512


def weights_port(environ: Mapping[str, str] | None = None) -> int:
    """The weight-sync store's port from `DAPO_WEIGHTS_PORT` (0 when unset); ConfigError naming
    the variable when it is not a port number."""
    raw = (os.environ if environ is None else environ).get(PORT_ENV, "").strip() or "0"
    if not raw.isdigit() or not 0 <= int(raw) <= 65535:
        raise ConfigError(f"{PORT_ENV}={raw!r} is not a port number (0-65535; 0: any free port)")
    return int(raw)


def dtype_of(name: str) -> torch.dtype:
    """torch dtype from its short name ("bfloat16"), as ParamSpec stores it; only `DTYPES`."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one weights travel in ({', '.join(DTYPES)})")
    return DTYPES[name]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


Bucket = tuple[ParamSpec, ...]


@dataclass(frozen=True)
class Announcement:
    """One weight sync: who takes part, where to rendezvous, and what the buckets hold."""

    policy_version: int
    """The policy version being sent."""
    membership_epoch: int
    """The membership epoch: +1 whenever the set of receivers changes (a fresh group)."""
    replicas: tuple[str, ...]
    """Replica ids; replica i has rank i + 1 (the learner is rank 0)."""
    store_host: str
    store_port: int
    backend: str
    timeout_s: float
    buckets: tuple[Bucket, ...]
    publisher: str = ""
    """A token unique to the publishing learner process (see `group_key`)."""
    issued_at: float = 0.0
    """The learner's clock when it announced (signed with the rest, unlike the stream entry's
    id): a replica takes an announcement only while it is fresh, so a copy added later is
    refused."""

    @property
    def world_size(self) -> int:
        return len(self.replicas) + 1

    @property
    def group_key(self) -> str:
        """Identity of the process group: a restarted learner serves a new store (possibly on the
        same port) and counts epochs from 1 again, so neither the address nor the epoch
        number is unique; the publisher token is."""
        return f"{self.store_host}:{self.store_port}/{self.publisher}/epoch{self.membership_epoch}"

    def rank_of(self, replica_id: str) -> int:
        return self.replicas.index(replica_id) + 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Announcement:
        """Parse an announcement; ValueError/TypeError/KeyError when it is not one (a replica
        skips such an entry instead of joining a rendezvous it describes)."""
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("replicas"), (list, tuple))
            or not all(isinstance(r, str) for r in data["replicas"])
        ):
            raise ValueError("an announcement is a JSON object whose replicas are a list of ids")
        if data["backend"] not in ("gloo", "nccl") or not isinstance(data["store_host"], str):
            raise ValueError(
                f"announcement backend {data['backend']!r} / store host {data['store_host']!r}"
            )
        if len(data["replicas"]) > MAX_REPLICAS or any(
            len(r) > MAX_NAME_CHARS for r in data["replicas"]
        ):
            raise ValueError("an announcement names too many replicas, or too long an id")
        buckets = tuple(
            tuple(
                ParamSpec(str(p["name"]), tuple(_dim(d) for d in p["shape"]), str(p["dtype"]))
                for p in bucket
            )
            for bucket in data["buckets"]
        )
        for bucket in buckets:
            if not bucket or len({p.dtype for p in bucket}) != 1:
                raise ValueError("an announced bucket is empty or mixes dtypes")
            dtype_of(bucket[0].dtype)  # from the table, or refused
        ann = cls(
            policy_version=_bounded(data["policy_version"], "policy version", 0, MAX_VERSION),
            membership_epoch=_bounded(data["membership_epoch"], "membership epoch", 0, MAX_VERSION),
            replicas=tuple(data["replicas"]),
            store_host=data["store_host"],
            store_port=_bounded(data["store_port"], "store port", 1, 65535),
            backend=data["backend"],
            timeout_s=float(data["timeout_s"]),
            buckets=buckets,
            publisher=str(data.get("publisher", "")),
            issued_at=float(data.get("issued_at", 0.0)),
        )
        if not (0 < ann.timeout_s <= MAX_TIMEOUT_S) or not math.isfinite(ann.timeout_s):
            raise ValueError(f"announcement time-out {ann.timeout_s!r} s is out of range")
        return ann


def _bounded(value: object, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"announcement {what} {value!r} is not an integer in [{low}, {high}]")
    return value


def _dim(value: object) -> int:
    return _bounded(value, "tensor dimension", 0, 2**40)


def check_buckets(ann: Announcement, expected: dict[str, tuple[int, ...]]) -> None:
    """ValueError unless the announced buckets hold exactly the parameters `expected` names (this
    replica's own model: every weight, or every adapter), each with its own shape: checked
    before a receive buffer is allocated, so an announcement cannot size one."""
    announced = {p.name: p.shape for bucket in ann.buckets for p in bucket}
    if sum(len(b) for b in ann.buckets) != len(announced):
        raise ValueError("an announcement names a parameter twice")
    missing, unknown = expected.keys() - announced.keys(), announced.keys() - expected.keys()
    if missing or unknown:
        raise ValueError(
            f"announced parameters do not match this model's: missing {sorted(missing)[:3]}, "
            f"unknown {sorted(unknown)[:3]}"
        )
    wrong = [n for n, shape in announced.items() if tuple(expected[n]) != shape]
    if wrong:
        name = wrong[0]
        raise ValueError(
            f"announced shape {announced[name]} for {name} (this model's: {expected[name]})"
        )


def plan_buckets(
    named: list[tuple[str, torch.Tensor]], bucket_mb: int, *, dtype: str | None = None
) -> tuple[Bucket, ...]:
    """Group parameters (in order) into buckets of one dtype and at most ~bucket_mb each
    (a tensor larger than the limit gets a bucket of its own). `dtype` sends every parameter in
    that dtype instead of its own (the serving dtype of the replicas)."""
    limit = bucket_mb * 2**20
    buckets: list[list[ParamSpec]] = []
    size = 0
    for name, t in named:
        dtype_name = dtype or str(t.dtype).removeprefix("torch.")
        nbytes = t.numel() * DTYPES[dtype_name].itemsize
        if (
            not buckets
            or buckets[-1][0].dtype != dtype_name
            or (size + nbytes > limit and buckets[-1])
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(ParamSpec(name, tuple(t.shape), dtype_name))
        size += nbytes
    return tuple(tuple(b) for b in buckets)


def bucket_numel(bucket: Bucket) -> int:
    return sum(p.numel for p in bucket)


def empty_bucket(bucket: Bucket, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(bucket_numel(bucket), dtype=dtype_of(bucket[0].dtype), device=device)


def unflatten(flat: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat`, one per parameter of `bucket` (no copy)."""
    out, offset = [], 0
    for p in bucket:
        out.append((p.name, flat[offset : offset + p.numel].view(p.shape)))
        offset += p.numel
    return out


def bound_store(host: str, port: int, timeout_s: float) -> tuple[Any, socket.socket]:
    """A TCPStore server that listens on `host` only (torch's own listens on every interface):
    the socket is bound here and handed to the store. Keep the socket object alive as long as
    the store (it owns the descriptor)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(512)
    store = TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        use_libuv=True,
    )
    return store, sock


def make_group(ann: Announcement, rank: int, *, is_master: bool = False) -> dist.ProcessGroup:
    """Rendezvous with the other members of `ann.membership_epoch` (blocks up to ann.timeout_s)."""
    timeout = timedelta(seconds=ann.timeout_s)
    store = TCPStore(
        ann.store_host, ann.store_port, is_master=is_master, timeout=timeout, wait_for_workers=False
    )
    return make_group_on_store(store, ann, rank)


def make_group_on_store(store: Any, ann: Announcement, rank: int) -> dist.ProcessGroup:
    timeout = timedelta(seconds=ann.timeout_s)
    prefixed = PrefixStore(f"dapo-weights-{ann.group_key}", store)
    if ann.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return cast(dist.ProcessGroup, dist.ProcessGroupNCCL(prefixed, rank, ann.world_size, opts))
    return cast(dist.ProcessGroup, dist.ProcessGroupGloo(prefixed, rank, ann.world_size, timeout))


def broadcast_bucket(group: dist.ProcessGroup, flat: torch.Tensor, timeout_s: float) -> None:
    """Broadcast `flat` from rank 0 (send on rank 0, receive in place elsewhere).

    Raises TimeoutError after `timeout_s`; the group must then be dropped (a timed-out
    collective leaves it in an unknown state)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([flat], opts)
    if not work.wait(timedelta(seconds=timeout_s)):
        raise TimeoutError(f"weight broadcast did not complete in {timeout_s}s")


def flat_broadcast_seconds(nbytes: int, *, replicas: int = 1, repeats: int = 5) -> float:
    """Median seconds of one bare gloo broadcast of `nbytes` from rank 0 (this process) to
    `replicas` receiving processes on this machine: the floor a weight sync of that size can
    reach here (what a sync is measured against). Each round starts after a barrier."""
    import multiprocessing
    import statistics

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ann = Announcement(
        policy_version=0,
        membership_epoch=0,
        replicas=tuple(f"probe{i}" for i in range(replicas)),
        store_host="127.0.0.1",
        store_port=store.port,
        backend="gloo",
        timeout_s=120.0,
        buckets=(),
    )
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_flat_receiver, args=(ann.to_json(), rank, nbytes, repeats + 1))
        for rank in range(1, ann.world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        group = make_group_on_store(store, ann, 0)
        flat, times = torch.zeros(nbytes, dtype=torch.uint8), []
        for _ in range(repeats + 1):
            group.barrier().wait()
            start = time.perf_counter()
            broadcast_bucket(group, flat, ann.timeout_s)
            times.append(time.perf_counter() - start)
        group.barrier().wait()  # every receiver has its copy
    finally:
        for proc in procs:
            proc.join(timeout=60)
    return statistics.median(times[1:])  # the first round warms the connections up


def _flat_receiver(ann_json: dict[str, Any], rank: int, nbytes: int, rounds: int) -> None:
    ann = Announcement.from_json(ann_json)
    store = TCPStore(
        ann.store_host, ann.store_port, is_master=False, timeout=timedelta(seconds=ann.timeout_s)
    )
    group = make_group_on_store(store, ann, rank)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        group.barrier().wait()
        broadcast_bucket(group, flat, ann.timeout_s)
    group.barrier().wait()


class _Receiver:
    """This process's receive group; rebuilt when the announced epoch changes, dropped on
    any error so the next sync builds a fresh one."""

    def __init__(self) -> None:
        self.group_key = ""
        self.group: dist.ProcessGroup | None = None
        self.buffers: dict[int, torch.Tensor] = {}
        """Host receive buffers by bucket index, reused from sync to sync: a fresh buffer would be
        paged in by the receive itself, on the critical path. Consumers copy the tensors out (an
        engine's `update_weights` keeps no reference past the sync). GPU buffers are not kept:
        the caching allocator makes them cheap, and keeping them would hold a model's worth of
        GPU memory between syncs."""

    def _buffer(self, index: int, bucket: Bucket, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return empty_bucket(bucket, device)
        key, numel = index, bucket_numel(bucket)
        flat = self.buffers.get(key)
        if flat is None or flat.numel() != numel or flat.dtype != dtype_of(bucket[0].dtype):
            flat = self.buffers[key] = empty_bucket(bucket, device)
        return flat

    def receive(
        self, ann: Announcement, rank: int, device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.monotonic()
        try:
            if self.group is None or self.group_key != ann.group_key:
                self.group, self.group_key = None, ""
                self.group = make_group(ann, rank)
                self.group_key = ann.group_key
            for index, bucket in enumerate(ann.buckets):
                flat = self._buffer(index, bucket, device)
                broadcast_bucket(self.group, flat, ann.timeout_s)
                yield from unflatten(flat, bucket)
        except BaseException:
            self.group, self.group_key = None, ""
            raise
        log.info(
            "received policy version %d in %.3fs", ann.policy_version, time.monotonic() - start
        )


_RECEIVER = _Receiver()
"""One per process: a process is at most one rank of one weight-sync group at a time."""


@dataclass(frozen=True)
class WeightStream:
    """One sync as an iterable of `(name, tensor)`; what `Engine.update_weights` receives.

    Picklable and JSON-able (`to_json`), so it can be handed to another process (vLLM's worker)
    and iterated there. Iterate it once, completely: a partial iteration leaves the learner's
    broadcast waiting for this rank until its timeout. Tensors are views of a received bucket
    on `device`; they stay valid after the iteration moves on (each bucket is a fresh buffer).
    Does NOT guarantee all-or-nothing: an error part-way raises after some tensors were yielded;
    an engine that applies tensors as they come must treat its weights as inconsistent then.
    """

    ann: Announcement
    rank: int
    device: str = "cpu"

    @property
    def policy_version(self) -> int:
        return self.ann.policy_version

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self.ann.buckets

    def on(self, device: str | torch.device) -> WeightStream:
        """The same stream received into `device` (e.g. the vLLM worker's GPU)."""
        return WeightStream(self.ann, self.rank, str(device))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return _RECEIVER.receive(self.ann, self.rank, torch.device(self.device))

    def to_json(self) -> dict[str, Any]:
        return {"ann": self.ann.to_json(), "rank": self.rank, "device": self.device}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightStream:
        return cls(
            Announcement.from_json(data["ann"]), int(data["rank"]), str(data.get("device", "cpu"))
        )


Entry = tuple[bytes, dict[bytes, bytes]]


class WeightChannel:
    """The Redis keys of a weight sync, written and read for both halves: the announcements
    stream (`Keys.weights`), each sync's join set and its go/abort decision. Writes go through
    the bus's fence, so a learner that lost its lease cannot announce."""

    def __init__(self, bus: RedisHygiene, key: WeightKey) -> None:
        """`key`: the learner's private key (it announces and decides), or a replica's public
        key (it verifies only)."""
        self.bus, self.key = bus, key
        self.stream = bus.keys.weights

    # --- the learner's side ----------------------------------------------------------------------
    def announce(self, ann: Announcement) -> None:
        body = json.dumps(ann.to_json()).encode()
        self.bus.write(
            "XADD", self.stream, "MAXLEN", "~", 1000, "*", "ann", body, "sig", sign(self.key, body)
        )

    def joined(self, ann: Announcement) -> set[str]:
        raw: Any = self.bus.redis.smembers(self.bus.keys.weight_join(ann.group_key))
        return {m.decode() for m in raw}

    def decide(self, ann: Announcement, decision: str, ttl_s: int) -> None:
        signed = f"{decision}:{sign(self.key, _decision_message(ann, decision))}"
        self.bus.write("SET", self.bus.keys.weight_decision(ann.group_key), signed, "EX", ttl_s)

    # --- a replica's side ------------------------------------------------------------------------
    def newest_id(self) -> str:
        """The id of the newest announcement, "0" when there is none: where a new replica starts."""
        last: Any = self.bus.redis.xrevrange(self.stream, count=1)
        return last[0][0].decode() if last else "0"

    def read(self, cursors: dict[str, str], block_ms: int | None) -> list[tuple[str, list[Entry]]]:
        """Entries after each cursor of `cursors` (the weights stream and any other stream the
        caller watches), blocking up to `block_ms` for the first; [] when none came."""
        streams: dict[Any, Any] = dict(cursors)
        reply: Any = self.bus.redis.xread(streams, count=64, block=block_ms)
        return [(s.decode() if isinstance(s, bytes) else s, entries) for s, entries in reply or []]

    def join(self, ann: Announcement, replica_id: str) -> None:
        key = self.bus.keys.weight_join(ann.group_key)
        self.bus.redis.sadd(key, replica_id)
        self.bus.redis.expire(key, int(ann.timeout_s * 4) + 60)

    def verified(self, fields: dict[bytes, bytes]) -> bytes:
        """The announcement JSON of a weights-stream entry whose signature holds; ValueError
        otherwise (not written by the learner: the replica skips it)."""
        body = fields.get(b"ann")
        if body is None or not signature_holds(self.key, body, fields.get(b"sig")):
            raise ValueError("not signed with this run's weight-sync key")
        return body

    def decision(self, ann: Announcement) -> bytes | None:
        """The learner's go/abort for `ann` once made; a value it did not sign reads as none yet
        (counted), so a planted "go" cannot start a broadcast nobody will send."""
        value: Any = self.bus.redis.get(self.bus.keys.weight_decision(ann.group_key))
        if value is None:
            return None
        decision, _, signature = bytes(value).partition(b":")
        if decision in (b"go", b"abort") and signature_holds(
            self.key, _decision_message(ann, decision.decode()), signature
        ):
            return decision
        self.bus.skip_bad_value(self.bus.keys.weight_decision(ann.group_key), "unsigned", value)
        return None


def _decision_message(ann: Announcement, decision: str) -> bytes:
    return f"{ann.group_key}|{ann.policy_version}|{decision}".encode()
