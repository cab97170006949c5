"""A discrete-event simulation of the pipeline (simpy), to predict a run before it exists.

It follows what the services do, hop by hop:

- the learner's feeder issues prompt jobs under admission control (`learner/feeder.py`): new
  jobs only while the groups expected to reach the learner stay below
  `(max_staleness + 1) x train_batch_groups`, and never more than `x oversampling` jobs in flight;
- each replica takes up to `prompts_per_batch` waiting jobs, generates their groups as one batch
  and hands them on when the batch is done (`rollout/service.py`), stamped with the policy
  version it held when the batch began; with `streaming` a replica instead refills its decode
  slots as responses finish (AReaL's and verl's fully asynchronous rollouts);
- reward workers score each group, the gatekeeper keeps a share `pass_rate` of them and counts
  the rest filtered, which frees their place in flight;
- the learner collects `train_batch_groups` groups no more than `max_staleness` versions old
  (older ones are dropped as stale), trains, publishes the weights (the replicas switch at once:
  in-flight updates) and frees the batch's places in flight;
- with `cpu_cores` (a run on CPU: the learner and the replicas compute on the same cores),
  generation and training share the cores: each computing process progresses at
  `min(1, cores / threads computing)` of its pace alone (processor sharing, `SharedCores`), so a
  replica generates faster while the learner waits than while it trains;
- `simulate_colocated` is the synchronous baseline of colocated systems (verl's default): every
  GPU generates the whole batch, then every GPU trains on it.

Generation, training and sync costs are inputs: measured rates (`calibration.measured_spec`) or
the hardware model (`costs`). What comes out is the steady state: step time, the learner's and
the replicas' idle fractions, staleness, tokens per second and Redis's memory and traffic.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import simpy

from services.planning.costs import DecodeModel, ResponseLengths

JOB_META_BYTES = 400
"""A prompt job's fields besides its token ids (JSON metadata, ids, schema version)."""
GROUP_META_BYTES_PER_RESPONSE = 120
"""A rollout group's per-response metadata (length, finish reason, versions) beside its packed
int32 token ids and float32 log-probs (`contracts/schemas/wire.py`)."""
METRICS_RECORD_BYTES = 2500
"""One per-step record in the metrics stream (about 50 named floats as JSON)."""


class SharedCores:
    """Processor sharing on `cores` CPU cores: while threads of several processes compute, each
    process progresses at min(1, cores / threads computing) of its pace alone (the kernel's fair
    scheduler, to a first approximation). A computation's work is the wall time it takes with
    the cores to itself; the time it really takes depends on who else computes meanwhile, and
    every start or end of a computation changes the pace of the others."""

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        self.env, self.cores = env, cores
        self.threads = 0
        self.changed = env.event()

    @property
    def pace(self) -> float:
        return min(1.0, self.cores / max(self.threads, 1))

    def _announce(self) -> None:
        self.changed.succeed()
        self.changed = self.env.event()

    def compute(self, work_s: float, threads: int = 1) -> Generator[Any, Any, float]:
        """Do `work_s` seconds of work with `threads` threads; returns the wall time it took."""
        began = self.env.now
        self.threads += threads
        self._announce()
        remaining = work_s
        while remaining > 1e-9 * max(work_s, 1.0):
            pace, since = self.pace, self.env.now
            yield self.env.timeout(remaining / pace) | self.changed
            remaining -= (self.env.now - since) * pace
        self.threads -= threads
        self._announce()
        return self.env.now - began


class Generation(Protocol):
    """How long a replica takes to generate one batch of responses."""

    def batch_seconds(self, lengths: Sequence[int], prompts: int) -> float: ...


@dataclass(frozen=True)
class MeasuredGeneration:
    """A measured rate: seconds per prompt group of a full batch (the CPU engines batch little,
    so a batch's time grows with its groups)."""

    seconds_per_group: float

    def batch_seconds(self, lengths: Sequence[int], prompts: int) -> float:
        return prompts * self.seconds_per_group


@dataclass(frozen=True)
class PipelineSpec:
    replicas: int
    prompts_per_batch: int
    group_size: int
    train_batch_groups: int
    oversampling: float
    max_staleness: int
    pass_rate: float
    generation: Generation
    learner_step_s: float
    """The learner's busy time per step: building the batch, the update, staging the weights."""
    sync_s: float
    """The weight broadcast to the replicas (the learner waits for it)."""
    lengths: ResponseLengths
    prompt_len: int
    reward_s_per_group: float = 0.0
    reward_workers: int = 1
    hop_s: float = 0.0
    """One atomic Redis hop (XACK + XDEL + XADD): four per group on its way to the learner."""
    streaming: bool = False
    """Replicas refill decode slots as responses finish instead of batch by batch (needs a
    `DecodeModel`)."""
    admission_batches: float | None = None
    """Kept groups allowed ahead of the learner, in batches (None: max_staleness + 1,
    as the feeder)."""
    drop_stale: bool = True
    cpu_cores: float | None = None
    """The CPU cores the learner and the replicas share (a run on CPU), or None where each has
    its own devices. With cores, `generation` and `learner_step_s` are the times each would take
    with the cores to itself (`SharedCores`)."""
    learner_threads: int = 1
    replica_threads: int = 1
    """Compute threads of the learner (all ranks) and of one replica, on shared cores."""


@dataclass(frozen=True)
class Prediction:
    step_s: float
    learner_idle: float
    rollout_idle: float
    mean_staleness: float
    """Mean policy-version lag of the groups trained."""
    stale_dropped_per_step: float
    tokens_per_s: float
    """Response tokens trained per second."""
    redis_peak_bytes: float
    redis_bytes_per_s: float
    """Stream traffic: every entry written once and read once per hop."""
    steps: int
    gen_s_per_group: float = 0.0
    """Mean over the trained groups of their batch's wall-clock generation time per group (what
    the learner records as `timing_s/gen_per_group`)."""
    learner_busy_s: float = 0.0
    """The learner's wall-clock time per step outside its waits for data (`timing_s/step`)."""

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


@dataclass
class _Job:
    version: int
    lengths: list[int]
    remaining: int = 0
    started_version: int = -1
    gen_s_per_group: float = 0.0


@dataclass
class _Group:
    version: int
    tokens: int
    bytes: int
    gen_s_per_group: float = 0.0


@dataclass
class _Stats:
    step_times: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    gen_per_group: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    trained_tokens: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    rollout_busy: float = 0.0
    rollout_busy_marks: list[float] = field(default_factory=list)
    redis_live: float = 0.0
    redis_peak: float = 0.0
    redis_traffic: float = 0.0
    redis_traffic_marks: list[float] = field(default_factory=list)


class _Pipeline:
    def __init__(
        self, env: simpy.Environment, spec: PipelineSpec, steps: int, rng: random.Random
    ) -> None:
        self.env, self.spec, self.steps, self.rng = env, spec, steps, rng
        self.prompts: simpy.Store = simpy.Store(env)
        self.train: deque[_Group] = deque()
        self.pending: list[_Group] = []
        """Groups the learner has read for its next batch."""
        self.rewarders = simpy.Resource(env, capacity=spec.reward_workers)
        self.version = 0
        self.in_flight = 0
        self.stale_total = 0
        self.wake = env.event()
        self.stats = _Stats()
        self.done = env.event()
        self.cores = SharedCores(env, spec.cpu_cores) if spec.cpu_cores is not None else None
        batches = (
            spec.admission_batches if spec.admission_batches is not None else spec.max_staleness + 1
        )
        self.kept_ahead = batches * spec.train_batch_groups
        self.limit = math.ceil(batches * spec.train_batch_groups * spec.oversampling)

    # --- Redis bookkeeping --------------------------------------------------------------------
    def _redis(self, delta: float, traffic: float = 0.0) -> None:
        self.stats.redis_live += delta
        self.stats.redis_peak = max(self.stats.redis_peak, self.stats.redis_live)
        self.stats.redis_traffic += traffic

    def _job_bytes(self) -> int:
        return JOB_META_BYTES + 4 * self.spec.prompt_len

    def _group_bytes(self, job: _Job) -> int:
        return (
            JOB_META_BYTES
            + 4 * self.spec.prompt_len
            + 8 * sum(job.lengths)
            + GROUP_META_BYTES_PER_RESPONSE * len(job.lengths)
        )

    def _notify(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    # --- feeder (learner rank 0, while it waits for data) --------------------------------------
    def admit(self) -> None:
        s = self.spec
        rate = min(max(s.pass_rate, 1e-3), 1.0)
        depth = len(self.train) + len(self.pending)  # XLEN: unread and read-but-untrained groups
        expected_kept = depth + (self.in_flight - depth) * rate
        room = self.kept_ahead - expected_kept
        if room <= 0:
            return
        n = max(0, min(math.ceil(room / rate), self.limit - self.in_flight))
        for _ in range(n):
            job = _Job(self.version, s.lengths.sample(self.rng, s.group_size))
            self.prompts.put(job)
            self._redis(self._job_bytes(), 2 * self._job_bytes())
        self.in_flight += n

    def _work(self, seconds: float, threads: int) -> Generator[Any, Any, float]:
        """`seconds` of a process's work: on the shared cores when there are, else on its own
        devices; returns the wall time."""
        if self.cores is None:
            yield self.env.timeout(seconds)
            return seconds
        return (yield from self.cores.compute(seconds, threads))

    # --- replicas -----------------------------------------------------------------------------
    def replica(self) -> Generator[Any, Any, None]:
        s = self.spec
        while True:
            first = yield self.prompts.get()
            jobs = [first]
            while len(jobs) < s.prompts_per_batch and self.prompts.items:
                jobs.append((yield self.prompts.get()))
            version = self.version
            work = s.generation.batch_seconds([n for j in jobs for n in j.lengths], len(jobs))
            seconds = yield from self._work(work, s.replica_threads)
            self.stats.rollout_busy += seconds
            for job in jobs:
                job.gen_s_per_group = seconds / len(jobs)
                self._finish(job, version)

    def streaming_replica(self, model: DecodeModel) -> Generator[Any, Any, None]:
        """Decode slots refilled as responses finish;
        a job's group is done with its last response."""
        slots = model.slots
        context = model.prompt_len + self.spec.lengths.mean / 2
        active: list[tuple[int, int, _Job]] = []  # (end step, tiebreak, job)
        waiting: deque[tuple[int, _Job]] = deque()
        step, tiebreak = 0, 0
        while True:
            while len(active) < slots and (waiting or self.prompts.items):
                if not waiting:
                    self._start(waiting, (yield self.prompts.get()))
                length, job = waiting.popleft()
                tiebreak += 1
                heapq.heappush(active, (step + length, tiebreak, job))
            if not active:
                self._start(waiting, (yield self.prompts.get()))
                continue
            per_step = model.step_seconds(len(active), context)
            until = active[0][0]
            started = self.env.now
            timer = self.env.timeout((until - step) * per_step)
            if len(active) < slots:  # a free slot: an arriving job starts at once
                arrival = self.prompts.get()
                fired = yield timer | arrival
                if arrival in fired:
                    self._start(waiting, arrival.value)  # type: ignore[arg-type]  # a StoreGet that fired holds its item
                    step += int((self.env.now - started) / per_step)
                    self.stats.rollout_busy += self.env.now - started
                    continue
                arrival.cancel()
            else:
                yield timer
            self.stats.rollout_busy += self.env.now - started
            step = until
            while active and active[0][0] <= step:
                _, _, job = heapq.heappop(active)
                job.remaining -= 1
                if job.remaining == 0:
                    self._finish(job, job.started_version)

    def _start(self, waiting: deque[tuple[int, _Job]], job: _Job) -> None:
        """A job's responses queue for decode slots; the group's version is the one held now."""
        job.remaining, job.started_version = len(job.lengths), self.version
        waiting.extend((n, job) for n in job.lengths)

    def _finish(self, job: _Job, version: int) -> None:
        self._redis(-self._job_bytes())
        self.env.process(self._score(job, version))

    # --- reward and gatekeeper ----------------------------------------------------------------
    def _score(self, job: _Job, version: int) -> Generator[Any, Any, None]:
        s = self.spec
        size = self._group_bytes(job)
        self._redis(size, 2 * size * 3)  # rollouts, scored and train streams: written and read
        with self.rewarders.request() as turn:
            yield turn
            yield self.env.timeout(s.reward_s_per_group + 3 * s.hop_s)
        if self.rng.random() < s.pass_rate:
            self.train.append(_Group(version, sum(job.lengths), size, job.gen_s_per_group))
        else:
            self.in_flight -= 1
            self._redis(-size)
        self._notify()

    # --- learner ------------------------------------------------------------------------------
    def _stale(self, group: _Group) -> bool:
        return self.spec.drop_stale and self.version - group.version > self.spec.max_staleness

    def _drop(self, group: _Group) -> None:
        self.in_flight -= 1
        self.stale_total += 1
        self._redis(-group.bytes)

    def learner(self) -> Generator[Any, Any, None]:
        s = self.spec
        last = self.env.now
        while len(self.stats.step_times) < self.steps:
            waited_from = self.env.now
            stale_before = self.stale_total
            while True:
                self.admit()
                while self.train and len(self.pending) < s.train_batch_groups:
                    group = self.train.popleft()
                    if self._stale(group):
                        self._drop(group)
                    else:
                        self.pending.append(group)
                if len(self.pending) >= s.train_batch_groups:
                    batch, self.pending = (
                        self.pending[: s.train_batch_groups],
                        self.pending[s.train_batch_groups :],
                    )
                    aged = [g for g in batch if self._stale(g)]
                    if not aged:
                        break
                    for g in aged:
                        self._drop(g)
                    self.pending = [g for g in batch if g not in aged] + self.pending
                    continue
                self.wake = self.env.event()
                yield self.wake
            self.stats.waits.append(self.env.now - waited_from)
            busy_from = self.env.now
            yield from self._work(s.learner_step_s, s.learner_threads)
            trained_on = self.version
            self.version += 1
            yield self.env.timeout(s.sync_s)
            self.stats.busy.append(self.env.now - busy_from)
            self.stats.gen_per_group.append(sum(g.gen_s_per_group for g in batch) / len(batch))
            self.in_flight -= len(batch)
            for g in batch:
                self._redis(-g.bytes)
            self.stats.lags.extend(trained_on - g.version for g in batch)
            self.stats.trained_tokens.append(sum(g.tokens for g in batch))
            self.stats.stale.append(self.stale_total - stale_before)
            self.stats.step_times.append(self.env.now - last)
            self.stats.rollout_busy_marks.append(self.stats.rollout_busy)
            self.stats.redis_traffic_marks.append(self.stats.redis_traffic)
            last = self.env.now
        self.done.succeed()


def simulate(
    spec: PipelineSpec,
    *,
    steps: int = 60,
    warmup: int = 10,
    seed: int = 0,
    decode: DecodeModel | None = None,
) -> Prediction:
    """The steady state of the pipeline over `steps` learner steps, the first `warmup` left out."""
    if spec.streaming and decode is None:
        raise ValueError("streaming replicas need a DecodeModel")
    if spec.streaming and spec.cpu_cores is not None:
        raise ValueError("streaming replicas are modelled on GPUs only (no shared CPU cores)")
    env = simpy.Environment()
    pipe = _Pipeline(env, spec, steps, random.Random(seed))
    for _ in range(spec.replicas):
        env.process(
            pipe.streaming_replica(decode)
            if spec.streaming and decode is not None
            else pipe.replica()
        )
    env.process(pipe.learner())
    env.run(until=pipe.done)
    return _steady(pipe.stats, spec.replicas, warmup, steps)


def _steady(st: _Stats, replicas: int, warmup: int, steps: int) -> Prediction:
    times = st.step_times[warmup:]
    span = sum(times)
    busy = (
        st.rollout_busy_marks[-1] - st.rollout_busy_marks[warmup - 1]
        if warmup
        else st.rollout_busy_marks[-1]
    )
    traffic = (
        st.redis_traffic_marks[-1] - st.redis_traffic_marks[warmup - 1]
        if warmup
        else st.redis_traffic_marks[-1]
    )
    lags = st.lags[warmup * (len(st.lags) // steps) :]
    return Prediction(
        step_s=span / len(times),
        learner_idle=sum(st.waits[warmup:]) / span,
        rollout_idle=max(0.0, 1.0 - busy / (replicas * span)),
        mean_staleness=sum(lags) / max(len(lags), 1),
        stale_dropped_per_step=sum(st.stale[warmup:]) / len(times),
        tokens_per_s=sum(st.trained_tokens[warmup:]) / span,
        redis_peak_bytes=st.redis_peak + METRICS_RECORD_BYTES * steps,
        redis_bytes_per_s=traffic / span,
        steps=len(times),
        gen_s_per_group=sum(st.gen_per_group[warmup:]) / len(times),
        learner_busy_s=sum(st.busy[warmup:]) / len(times),
    )


@dataclass(frozen=True)
class ColocatedSpec:
    """The synchronous colocated baseline: all `replicas` generate the batch,
    then every GPU trains."""

    replicas: int
    train_batch_groups: int
    group_size: int
    pass_rate: float
    generation: Generation
    learner_step_s: float
    switch_s: float
    """Per step: handing the GPUs from generation to training and back (weights resharded)."""
    lengths: ResponseLengths


def simulate_colocated(spec: ColocatedSpec, *, steps: int = 30, seed: int = 0) -> Prediction:
    """Generation and training take turns on the same GPUs; a generation round covers the batch
    (more rounds when the gatekeeper filters), split evenly over the replicas, and ends with the
    slowest replica."""
    env = simpy.Environment()
    rng = random.Random(seed)
    st = _Stats()

    def loop() -> Generator[Any, Any, None]:
        for _ in range(steps):
            start, kept, generating = env.now, 0.0, 0.0
            while kept < spec.train_batch_groups:
                jobs = math.ceil((spec.train_batch_groups - kept) / max(spec.pass_rate, 1e-3))
                per = [
                    jobs // spec.replicas + (1 if i < jobs % spec.replicas else 0)
                    for i in range(spec.replicas)
                ]
                rounds = [
                    spec.generation.batch_seconds(spec.lengths.sample(rng, n * spec.group_size), n)
                    for n in per
                    if n
                ]
                yield env.timeout(max(rounds))
                generating += sum(rounds) / spec.replicas
                kept += jobs * spec.pass_rate
            yield env.timeout(spec.learner_step_s + spec.switch_s)
            st.step_times.append(env.now - start)
            st.waits.append(env.now - start - spec.learner_step_s)
            st.rollout_busy += generating
            st.rollout_busy_marks.append(st.rollout_busy)
            st.trained_tokens.append(
                round(spec.train_batch_groups * spec.group_size * spec.lengths.mean)
            )
            st.redis_traffic_marks.append(0.0)
            st.stale.append(0)

    env.run(until=env.process(loop()))
    times = st.step_times
    span = sum(times)
    return Prediction(
        step_s=span / len(times),
        learner_idle=sum(st.waits) / span,
        rollout_idle=1.0 - st.rollout_busy / span,
        mean_staleness=0.0,
        stale_dropped_per_step=0.0,
        tokens_per_s=sum(st.trained_tokens) / span,
        redis_peak_bytes=0.0,
        redis_bytes_per_s=0.0,
        steps=len(times),
    )


def with_staleness(spec: PipelineSpec, max_staleness: int) -> PipelineSpec:
    return replace(spec, max_staleness=max_staleness, admission_batches=None)
