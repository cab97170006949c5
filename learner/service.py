"""`dapo learner`: the DAPO learner process (one per rank; launch with torchrun for several).

Rank 0 (the Coordinator) owns everything that touches Redis and decides, at each step boundary,
the next command for all ranks: `train` a batch of `train_batch_groups` kept groups, `wait`
(data still arriving, or paused: this keeps the other ranks' collectives alive), `checkpoint`,
`restore` a checkpoint, or `stop`. Every rank then executes it. After a training step all ranks
gather the new weights, and rank 0 publishes them to the rollout replicas as policy version + 1,
acknowledges the trained groups, evaluates when due and reports metrics.

On start the learner resumes from the newest committed checkpoint if there is one (a restarted
process continues the run; `dapo run` without --resume starts a fresh store). When it completes
`total_steps` it drains the pipeline, so every issued job is accounted for (in_flight = 0). On
SIGTERM it finishes the current step, commits a checkpoint and exits 0 without draining: the
work in flight stays queued for the learner that resumes.

Departures from the paper: asynchronous (bounded staleness with importance-weight correction,
DAPO.md s9; `max_staleness: 0` is the synchronous algorithm), and evaluation runs on rank 0 with
the transformers engine (fine for small models; large models should evaluate on rollout replicas).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import redis
import torch
import torch.distributed as dist

from learner.batch import build_batch
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.coordinator import Coordinator
from learner.trainer import Trainer
from services.contracts.checkpoint_store import apply_retention, get_checkpoint, latest_checkpoint
from services.contracts.config import DapoConfig
from services.contracts.faults import stretch
from services.contracts.keys import Counter, RunField
from services.contracts.runtime import StopFlag

log = logging.getLogger(__name__)

Command = dict[str, Any]


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
    if "MASTER_PORT" not in os.environ:
        from services.contracts.runtime import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.learner.collective_timeout_s))
    return dist.get_rank(), dist.get_world_size(), backend


def _share(obj: Any, rank: int) -> Any:
    """Rank 0's object to every rank (the learner's own trusted group, not the wire)."""
    box = [obj if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def next_command(cfg: DapoConfig, coord: Coordinator) -> Command:
    """Rank 0 decides what all ranks do next; `wait` while Redis is unreachable (the client
    already retried with back-off), so a Redis restart costs time, not the run."""
    try:
        coord.check_redis_state()
        return _decide(cfg, coord)
    except redis.ConnectionError as exc:
        log.warning("redis unavailable (%s); waiting", exc)
        time.sleep(1.0)
        return {"cmd": "wait"}


def _decide(cfg: DapoConfig, coord: Coordinator) -> Command:
    requests = coord.control_requests()
    if coord.stop.stopping or coord.step >= cfg.learner.total_steps:
        return {"cmd": "stop"}
    if "restore" in requests:
        coord.clear_request("restore")
        return {"cmd": "restore", "step": int(requests["restore"]["step"])}
    if "checkpoint" in requests:
        coord.clear_request("checkpoint")
        return {"cmd": "checkpoint", "keep": bool(requests["checkpoint"].get("keep"))}
    if "pause" in requests:
        coord.set_state("paused")
        time.sleep(1.0)
        return {"cmd": "wait"}
    picked = coord.collect()
    if picked is None:
        return {"cmd": "wait"}
    coord.picked = picked
    return {"cmd": "train", "groups": [g for _, g in picked]}


class Learner:
    """What every rank does with a command."""

    def __init__(self, cfg: DapoConfig, trainer: Trainer, coord: Coordinator | None, rank: int) -> None:
        self.cfg, self.trainer, self.coord, self.rank = cfg, trainer, coord, rank
        self.layout = trainer.param_shapes()
        self.step = 0

    def publish(self, version: int) -> None:
        """Gather full weights (all ranks); rank 0 stages and broadcasts them as `version`."""
        named = self.trainer.named_full_params()
        if self.coord is None:
            for _ in named:
                pass
            return
        self.coord.set_state("broadcasting")
        self.coord.version = version
        self.coord.publisher.stage(version, named, self.layout)
        self.coord.bus.set_policy_version(version)
        self.coord.publisher.publish()

    def train(self, groups: list[Any]) -> None:
        cfg, coord = self.cfg, self.coord
        self.step += 1
        t0 = time.monotonic()
        if coord is not None:
            coord.step = self.step
            coord.set_state("training")
        batch = build_batch(groups, pad_id=0, norm_by_std=cfg.algorithm.norm_by_std, overlong_filter=cfg.reward.overlong.filter)
        version = _share(coord.version if coord is not None else None, self.rank)
        metrics = self.trainer.train_step(batch, learner_version=version)
        stretch("learner.slowdown", time.monotonic() - t0)  # fault suite only (services/contracts/faults.py)
        t1 = time.monotonic()
        rollout_metrics = coord.rollout_metrics(groups) if coord is not None else {}
        self.publish(version + 1)
        if coord is None:
            return
        coord.mark_trained()
        metrics.update(rollout_metrics)
        wall = time.monotonic() - coord.started
        metrics.update({"timing/train_s": t1 - t0, "timing/sync_s": coord.publisher.last_sync_s,
                        "timing/learner_idle_fraction": coord.wait_s / wall})
        every = cfg.eval.every_steps
        if every and self.step % every == 0 and self.step != cfg.learner.total_steps:
            metrics.update(coord.run_eval())
        coord.report(metrics)

    def checkpoint(self, keep: bool = False) -> None:
        cfg, coord = self.cfg, self.coord
        if coord is not None:
            coord.set_state("checkpointing")
        meta = _share(coord.checkpoint_meta() if coord is not None else None, self.rank)
        path = save_checkpoint(
            cfg.checkpoint_dir, self.step, model=self.trainer.model, optimizer=self.trainer.optimizer,
            scheduler=self.trainer.scheduler, rank=self.rank, meta=meta,
            hf_export=coord.export_hf if coord is not None and cfg.checkpoint.save_hf else None, barrier=dist.barrier,
        )
        if self.rank == 0:
            if keep:
                (path / "keep").touch()
            removed = apply_retention(cfg.checkpoint_dir, cfg.checkpoint.keep_last)
            if removed:
                log.info("retention removed checkpoints %s", removed)

    def restore(self, step: int, *, publish: bool = True) -> None:
        info = get_checkpoint(self.cfg.checkpoint_dir, step)
        if info is None:  # the API checks too; a race with retention lands here
            log.error("checkpoint step %d is gone; ignoring the restore request", step)
            return
        if self.coord is not None:
            self.coord.set_state("restoring")
        meta = load_checkpoint(info, model=self.trainer.model, optimizer=self.trainer.optimizer, scheduler=self.trainer.scheduler)
        self.step = int(meta["step"])
        if self.coord is not None:
            self.coord.resume_from(meta)
            if publish:  # an operator's restore (not a restart)
                self.coord.bus.incr(Counter.RESTORES)
        log.info("restored checkpoint step %d", step)
        if publish:
            version = _share(self.coord.version if self.coord is not None else None, self.rank)
            self.publish(version)

    def run(self) -> None:
        every = self.cfg.checkpoint.every_steps
        while True:
            command = _share(next_command(self.cfg, self.coord) if self.coord is not None else None, self.rank)
            kind = command["cmd"]
            if kind == "stop":
                return
            if kind == "train":
                self.train(command["groups"])
                if every and self.step % every == 0:
                    self.checkpoint()
            elif kind == "checkpoint":
                self.checkpoint(keep=command["keep"])
            elif kind == "restore":
                self.restore(command["step"])


def main(cfg: DapoConfig) -> int:
    stop = StopFlag().install()
    rank, world, backend = init_distributed(cfg)
    torch.manual_seed(cfg.learner.seed + rank)
    if cfg.learner.torch_threads:
        torch.set_num_threads(cfg.learner.torch_threads)
    trainer = Trainer(cfg, rank=rank, world_size=world, backend=backend)
    coord = Coordinator(cfg, trainer, backend, stop) if rank == 0 else None
    learner = Learner(cfg, trainer, coord, rank)
    try:
        latest = latest_checkpoint(cfg.checkpoint_dir)
        if latest is not None:
            log.info("resuming from %s", latest.path)
            learner.restore(latest.step, publish=False)
        elif coord is not None:
            coord.resume_from(None)
        version = _share(coord.version if coord is not None else None, rank)
        learner.publish(version)  # stage the starting weights (and sync replicas on a resume)
        if coord is not None and not coord.evals:
            base = coord.run_eval()
            coord.bus.update_run_info({RunField.BASE_EVAL_ACC: base.get("eval/acc", -1.0)})
        learner.run()
        if learner.step and (cfg.checkpoint.every_steps == 0 or learner.step % cfg.checkpoint.every_steps):
            learner.checkpoint()  # the end of the run is always checkpointed
        if coord is not None:
            coord.finish()
    finally:
        if coord is not None:
            coord.hb.stop()
        dist.destroy_process_group()
    return 0
