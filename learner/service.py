"""`dapo learner`: the DAPO learner process (one per rank; launch with torchrun for several).

This module assembles the process: the training process group, the trainer, and the loop's
collaborators (`learner/loop.py`). Rank 0 gets the real ones (Redis, the weight publisher, the
evaluation lane, trackers); the other ranks get null ones and follow rank
0's commands.

Departures from the paper: asynchronous (bounded staleness with importance-weight correction,
docs/algorithm.md s9; `max_staleness: 0` is the synchronous algorithm).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from contracts.bus import FencedError, StreamBus, open_bus
from contracts.bus.roles import Role, consumed_stages
from contracts.checkpoint_store import CheckpointRefused
from contracts.config import ConfigError, DapoConfig
from contracts.data import load_prompts
from contracts.lease import LearnerLease, LeaseHeldError
from contracts.model_source import with_local_model
from contracts.runtime import (
    CHECKPOINT_REFUSED_FILE,
    EXIT_CHECKPOINT_REFUSED,
    EXIT_NOT_THE_LEARNER,
    StopFlag,
    free_port,
    instance_id,
)
from contracts.signing import SigningKey, weights_key
from contracts.weight_sync import weights_port
from learner.checkpoint import Checkpoints
from learner.collect import StreamSource
from learner.control import RunControl
from learner.evaluation import eval_lane
from learner.export import HFExporter
from learner.feeder import PromptFeeder, budget_jobs
from learner.loop import Collaborators, LearnerLoop, Share
from learner.report import CompletionSampler, RunReporter
from learner.tracking import Trackers
from learner.trainer import Trainer
from learner.weight_publisher import WeightPublisher

T = TypeVar("T")
log = logging.getLogger(__name__)


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


def init_distributed(cfg: DapoConfig) -> tuple[int, int, str]:
    backend = resolve_backend(cfg.learner.backend)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.learner.collective_timeout_s))
    return dist.get_rank(), dist.get_world_size(), backend


def make_share(rank: int) -> Share:
    """Rank 0's value to every rank, over the learner's own (trusted) process group."""

    def share(value: T) -> T:
        box: list[Any] = [value if rank == 0 else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        out: T = box[0]
        return out

    return share


@dataclass(frozen=True)
class RunClaim:
    """What rank 0 holds once it is this run's learner: its Redis connection,
    fenced by the lease."""

    bus: StreamBus
    lease: LearnerLease
    instance: str


def claim_the_run(cfg: DapoConfig, stop: StopFlag) -> RunClaim:
    """Rank 0 connects to Redis and takes the learner lease (raises LeaseHeldError after
    `learner.lease_wait_s` when another learner holds it)."""
    url = cfg.redis_url_for(Role.LEARNER)
    if not url:
        raise ConfigError("dapo learner: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)")
    if cfg.learner.lease_wait_s <= cfg.learner.lease_ttl_s:
        log.warning(
            "learner.lease_wait_s (%.0f s) is not above learner.lease_ttl_s (%.0f s): a learner "
            "restarted after an unclean exit may still find its predecessor's lease, and exit as "
            "not the learner",
            cfg.learner.lease_wait_s,
            cfg.learner.lease_ttl_s,
        )
    inst = instance_id("learner")
    # At maxmemory rank 0 pauses on the refused write, even when asked to stop: giving up half
    # way through a step could record groups as trained in Redis but not in a checkpoint; if
    # the pause outlasts the grace period, SIGKILL and a restart lose nothing. With several
    # ranks, a pause longer than learner.collective_timeout_s times the others out (a restart).
    bus = open_bus(url, cfg.queue.namespace, inst)
    lease = LearnerLease(bus, holder=inst, ttl_s=cfg.learner.lease_ttl_s)
    lease.acquire(cfg.learner.lease_wait_s, stop.event)  # before any write: one learner per run
    return RunClaim(bus, lease, inst)


def rank0_collaborators(
    cfg: DapoConfig, backend: str, stop: StopFlag, claim: RunClaim
) -> Collaborators:
    """Rank 0's side: Redis, feeding and collecting, publishing, evaluation, reporting. Each
    collaborator is handed the parts of the bus it uses (docs/architecture.md)."""
    from transformers import AutoTokenizer

    bus = claim.bus
    bus.check_memory_policy()
    bus.ensure_groups(consumed_stages(Role.LEARNER, bus.keys))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    key = weights_key()  # the learner's own: it signs jobs and weight announcements
    feeder = _feeder(cfg, bus, tokenizer, key)
    publisher = _publisher(cfg, bus, backend, key)
    sampler = CompletionSampler.from_config(cfg.tracking, cast(Any, tokenizer).decode)
    return Collaborators(
        source=_source(cfg, bus, feeder, stop, catch_up=publisher.catch_up, key=key),
        publisher=publisher,
        evaluations=eval_lane(
            cfg,
            tokenizer,
            catch_up=publisher.catch_up,
            transport=bus,
            run_state=bus,
            job_key=key,
        ),
        exporter=HFExporter(
            cfg.model.path, lora=cfg.learner.lora if cfg.learner.lora.enabled else None
        ),
        reporter=RunReporter(Trackers(cfg), sampler, transport=bus, run_state=bus, telemetry=bus),
        control=RunControl(
            run_state=bus,
            telemetry=bus,
            run_name=cfg.run_name,
            instance=claim.instance,
            heartbeat_ttl_s=cfg.queue.heartbeat_ttl_s,
            lease=claim.lease,
        ),
    )


def _feeder(cfg: DapoConfig, bus: StreamBus, tokenizer: Any, key: SigningKey) -> PromptFeeder:
    """Prompt jobs out, each signed, at most what admission control allows in flight."""
    alg = cfg.algorithm
    return PromptFeeder(
        load_prompts(cfg.data.train_path, columns=cfg.data.columns),
        tokenizer,
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
        run_name=cfg.run_name,
        limit=PromptFeeder.admission_limit(
            alg.max_staleness, alg.train_batch_groups, alg.oversampling
        ),
        kept_ahead=(alg.max_staleness + 1) * alg.train_batch_groups,
        max_prompt_len=cfg.data.max_prompt_len,
        chat=cfg.data.chat,
        shuffle=cfg.data.shuffle,
        seed=cfg.data.seed,
        max_jobs=budget_jobs(cfg.learner.sample_budget, cfg.rollout.group_size),
        skip=alg.prompt_skip,
        pass_rate_window=alg.pass_rate_window,
        job_key=key,  # every job signed: reward and the learner take no job it did not issue
    )


def _publisher(cfg: DapoConfig, bus: StreamBus, backend: str, key: SigningKey) -> WeightPublisher:
    """Weights out to the replicas: broadcast bucket by bucket, every announcement signed."""
    le = cfg.learner
    return WeightPublisher(
        run_state=bus,
        telemetry=bus,
        host=os.environ.get("DAPO_WEIGHTS_HOST", "127.0.0.1"),
        port=weights_port(),
        backend=backend if le.weights_backend == "auto" else le.weights_backend,
        timeout_s=le.collective_timeout_s,
        bucket_mb=le.broadcast_bucket_mb,
        dtype=cfg.model.dtype,
        key=key,
    )


def _source(
    cfg: DapoConfig,
    bus: StreamBus,
    feeder: PromptFeeder,
    stop: StopFlag,
    *,
    catch_up: Callable[[], None],
    key: SigningKey,
) -> StreamSource:
    """Kept groups in from the train stream, refused unless signed, no larger than the run can
    generate, within the model's vocabulary."""
    from transformers import AutoConfig

    return StreamSource(
        feeder,
        transport=bus,
        run_state=bus,
        batch_groups=cfg.algorithm.train_batch_groups,
        max_staleness=cfg.algorithm.max_staleness,
        max_deliveries=cfg.queue.max_deliveries,
        stop=stop,
        catch_up=catch_up,
        vocab_size=AutoConfig.from_pretrained(cfg.model.path).vocab_size,  # embedding rows
        sizes={
            "max_prompt_tokens": cfg.data.max_prompt_len,
            "max_response_tokens": cfg.rollout.max_response_len
            + cfg.rollout.tools.inserted_tokens_max,
            "max_responses": max(cfg.rollout.group_size, cfg.eval.samples_per_problem),
        },
        job_key=key,
    )


def main(cfg: DapoConfig) -> int:
    # An hf:// model: each rank takes the cache's snapshot (downloaded by whichever gets there
    # first), before the process group forms, so a download never runs into its timeout.
    cfg = with_local_model(cfg)
    if os.environ.get("RANK", "0") == "0":
        weights_key()  # rank 0 signs the weight announcements: refuse to start without the key
    stop = StopFlag().install()
    rank, world, backend = init_distributed(cfg)
    torch.manual_seed(cfg.learner.seed + rank)
    if cfg.learner.torch_threads:
        torch.set_num_threads(cfg.learner.torch_threads)
    try:
        return _train(cfg, rank, world, backend, stop)
    except (
        LeaseHeldError,
        FencedError,
    ) as exc:  # another learner trains this run: not a crash to debug
        if rank == 0:
            log.error("%s", exc)
        return EXIT_NOT_THE_LEARNER
    except CheckpointRefused as exc:
        message = (
            f"{exc}. Move that step out of {cfg.checkpoint_dir} (or restore it from a copy you "
            "trust) and start again: the learner resumes from the newest checkpoint that verifies."
        )
        log.error("%s", message)
        with contextlib.suppress(OSError):  # every rank refuses alike; any of them may say so
            (Path(cfg.output_dir) / CHECKPOINT_REFUSED_FILE).write_text(message + "\n")
        return EXIT_CHECKPOINT_REFUSED
    except BaseException as exc:  # a crash: its tracebacks must not keep the model alive (below)
        seen: set[int] = set()
        cause: BaseException | None = exc
        while cause is not None and id(cause) not in seen:  # the exception and those it wraps
            seen.add(id(cause))
            traceback.clear_frames(cause.__traceback__)
            cause = cause.__cause__ or cause.__context__
        raise
    finally:
        # The sharded model holds the process group, and the loop's objects refer to each other:
        # collect them now, while the interpreter is whole. Left to interpreter finalization,
        # gloo's threads are torn down there, which can abort the process (SIGABRT), turning
        # the exit code the orchestrator acts on (3, 4, 0) into a crash.
        gc.collect()
        dist.destroy_process_group()


def _train(cfg: DapoConfig, rank: int, world: int, backend: str, stop: StopFlag) -> int:
    claim = _claim_on_every_rank(cfg, rank, world, stop)
    try:
        trainer = Trainer(cfg, rank=rank, world_size=world, backend=backend)
        checkpoints = Checkpoints(
            cfg.checkpoint_dir,
            trainer=trainer,
            rank=rank,
            keep_last=cfg.checkpoint.keep_last,
            save_hf=cfg.checkpoint.save_hf,
            barrier=dist.barrier,
        )
        loop = LearnerLoop(
            cfg,
            trainer=trainer,
            checkpoints=checkpoints,
            collaborators=(
                rank0_collaborators(cfg, backend, stop, claim)
                if claim is not None
                else Collaborators.null()
            ),
            share=make_share(rank),
            stop=stop,
        )
    except BaseException:
        if claim is not None:  # never trained: the next learner need not wait out the lease's TTL
            claim.lease.release()
        raise
    return loop.run()  # releases the lease when it ends


def _claim_on_every_rank(cfg: DapoConfig, rank: int, world: int, stop: StopFlag) -> RunClaim | None:
    """Rank 0 takes the lease before anything is loaded (its claim; None on the other ranks), and
    every rank learns the verdict: when another learner holds the run, every rank exits
    EXIT_NOT_THE_LEARNER. Otherwise the other ranks would fail on a collective rank 0 left, and
    torchrun (learner_torchrun) might report their failure, a crash worth a retry, instead.

    The verdict travels over a gloo group of its own, whose timeout covers rank 0's wait for the
    lease (up to learner.lease_wait_s, longer than the training group's collective timeout)."""
    claim: RunClaim | None = None
    verdict: tuple[str, str] | None = None  # ("lease" | "failed", why)
    failure: BaseException | None = None
    if rank == 0:
        try:
            claim = claim_the_run(cfg, stop)
        except LeaseHeldError as exc:
            verdict = ("lease", str(exc))
        except Exception as exc:  # no Redis, a bad URL: rank 0 raises it, the others stop at once
            verdict, failure = ("failed", f"{type(exc).__name__}: {exc}"), exc
    if world > 1:
        wait = timedelta(seconds=cfg.learner.lease_wait_s + cfg.learner.collective_timeout_s)
        group = dist.new_group(backend="gloo", timeout=wait)
        box: list[Any] = [verdict]
        dist.broadcast_object_list(box, src=0, group=group)
        dist.destroy_process_group(group)
        verdict = box[0]
    if failure is not None:
        raise failure
    if verdict is not None:
        kind, why = verdict
        if kind == "lease":
            raise LeaseHeldError(why)
        raise RuntimeError(f"learner rank 0 could not claim the run: {why}")
    return claim
