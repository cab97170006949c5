"""`dapo learner`: the DAPO learner process (one per rank; launch with torchrun for several).

Rank 0 owns everything that touches Redis: it feeds prompts (admission control), collects
`train_batch_groups` kept groups, drops groups older than `max_staleness` versions (counted
`stale`), and hands the groups to every rank. All ranks then run one FSDP2 update, gather the new
weights, and rank 0 publishes them to the rollout replicas as policy version + 1, acknowledges the
trained groups, evaluates when due and reports metrics. At the end it drains the pipeline so every
issued job is accounted for (in_flight = 0 after a clean stop).

Departures from the paper: asynchronous (bounded staleness with importance-weight correction,
DAPO.md s9; `max_staleness: 0` is the synchronous algorithm), and evaluation runs on rank 0 with
the transformers engine (fine for small models; large models should evaluate on rollout replicas).
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from learner.batch import build_batch
from learner.broadcast import WeightPublisher
from learner.evaluate import eval_prompts, evaluate
from learner.feeder import PromptFeeder
from learner.trainer import Trainer
from services.config import DapoConfig
from services.data import load_prompts
from services.keys import LEDGER_STALE, LEDGER_TRAINED, Keys
from services.schemas import RolloutGroup, SchemaError, decode_group
from services.streams import StreamBus, connect
from services.weight_group import unflatten
from services.worker import Heartbeat, StopFlag, instance_id

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
    if "MASTER_PORT" not in os.environ:
        from services.redis_server import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.learner.collective_timeout_s))
    return dist.get_rank(), dist.get_world_size(), backend


class Coordinator:
    """Rank 0's side: Redis, feeding, collecting, publishing, evaluating, reporting."""

    def __init__(self, cfg: DapoConfig, trainer: Trainer, backend: str, stop: StopFlag) -> None:
        from transformers import AutoTokenizer

        from rollout.hf_engine import HFEngine

        url = cfg.redis_url
        if not url:
            raise SystemExit("dapo learner: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)")
        self.cfg, self.trainer, self.stop = cfg, trainer, stop
        self.inst = instance_id("learner")
        self.bus = StreamBus(connect(url), Keys(cfg.queue.namespace), consumer=self.inst)
        self.bus.ensure_groups()
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        alg = cfg.algorithm
        self.feeder = PromptFeeder(
            self.bus, load_prompts(cfg.data.train_path), self.tokenizer, run_name=cfg.run_name,
            limit=PromptFeeder.admission_limit(alg.max_staleness, alg.train_batch_groups, alg.oversampling),
            max_prompt_len=cfg.data.max_prompt_len, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
        )
        self.publisher = WeightPublisher(
            self.bus, host=os.environ.get("DAPO_WEIGHTS_HOST", "127.0.0.1"), port=0, backend=backend,
            timeout_s=cfg.learner.collective_timeout_s, bucket_mb=cfg.learner.broadcast_bucket_mb,
        )
        self.eval_engine = HFEngine(cfg.model.path, seed=cfg.learner.seed)
        self.eval_records, self.eval_ids = eval_prompts(cfg, self.tokenizer)
        self.version = 0
        self.step = 0
        self.state = "starting"
        self.wait_s = 0.0
        self.started = time.monotonic()
        self.lags: list[float] = []
        self.evals: list[tuple[int, float]] = []
        self.hb = Heartbeat(self.bus.r, self.bus.keys, "learner", self.inst, cfg.queue.heartbeat_ttl_s, self.status).start()
        self.bus.r.set(self.bus.keys.policy_version, self.version)

    def status(self) -> dict[str, Any]:
        return {"policy_version": self.version, "step": self.step, "state": self.state}

    def set_state(self, state: str) -> None:
        self.state = state
        self.bus.r.hset(self.bus.keys.learner_state, mapping={"state": state, "step": self.step, "policy_version": self.version, "at": time.time()})

    # --- data in ------------------------------------------------------------------------------
    def collect(self) -> list[tuple[str, RolloutGroup]]:
        """Block until train_batch_groups fresh kept groups are in hand (or stopping)."""
        need, got = self.cfg.algorithm.train_batch_groups, []
        stage, start = self.bus.keys.train, time.monotonic()
        self.set_state("waiting for data")
        while len(got) < need and not self.stop.stopping:
            self.feeder.admit(self.version)
            for entry_id, fields in self.bus.read(stage, count=need - len(got), block_ms=200):
                try:
                    group = decode_group(fields)
                except SchemaError as exc:
                    self.bus.dead_letter(stage, entry_id, fields, f"learner: {exc}")
                    continue
                if self.version - group.policy_version > self.cfg.algorithm.max_staleness:
                    self.bus.hop(stage, entry_id, outcome=LEDGER_STALE)
                else:
                    got.append((entry_id, group))
            self.publisher.catch_up()
        self.wait_s += time.monotonic() - start
        return got

    # --- reporting ----------------------------------------------------------------------------
    def rollout_metrics(self, groups: list[RolloutGroup]) -> dict[str, float]:
        rewards = [r for g in groups for r in (g.rewards or [])]
        accs = [float(a) for g in groups for a in (g.acc or [])]
        lengths = [len(r.token_ids) for g in groups for r in g.responses]
        lags = [float(self.version - g.policy_version) for g in groups]
        self.lags.extend(lags)
        counters = {k.decode(): int(v) for k, v in self.bus.r.hgetall(self.bus.keys.counters).items()}
        ledger = self.bus.ledger()
        kept, filtered = counters.get("gate_kept", 0), ledger.filtered
        return {
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/acc_mean": sum(accs) / len(accs),
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_max": float(max(lengths)),
            "rollout/clip_ratio": sum(r.finish_reason == "length" for g in groups for r in g.responses) / len(lengths),
            "rollout/version_lag_mean": sum(lags) / len(lags),
            "rollout/tokens": float(sum(lengths)),
            "rollout/groups": float(len(groups)),
            **{f"depth/{stage}": float(n) for stage, n in self.bus.depths().items()},
            "gate/pass_rate": kept / (kept + filtered) if kept + filtered else 0.0,
            "gate/filtered_total": float(filtered),
            "ledger/issued": float(ledger.issued),
            "ledger/in_flight": float(ledger.in_flight),
        }

    def report(self, metrics: dict[str, float]) -> None:
        record = {"step": self.step, "policy_version": self.version, "time": time.time(), **metrics}
        self.bus.r.xadd(self.bus.keys.metrics, {"m": json.dumps(record)}, maxlen=100_000, approximate=True)
        log.info(
            "step %d v%d reward %.3f acc %.3f pass %.2f lag %.2f clip %.3f/%.3f kl %.4f %s",
            self.step, self.version, metrics.get("rollout/reward_mean", 0), metrics.get("rollout/acc_mean", 0),
            metrics.get("gate/pass_rate", 0), metrics.get("rollout/version_lag_mean", 0),
            metrics.get("actor/clipfrac_high", 0), metrics.get("actor/clipfrac_low", 0),
            metrics.get("actor/approx_kl", 0),
            f"eval {metrics['eval/acc']:.3f}" if "eval/acc" in metrics else "",
        )

    def run_eval(self) -> dict[str, float]:
        if not self.eval_records:
            return {}
        self.set_state("evaluating")
        if self.publisher.version >= 0:
            params = dict(self.eval_engine.model.named_parameters())
            with torch.no_grad():
                for flat, bucket in zip(self.publisher.flat, self.publisher.buckets, strict=True):
                    for name, tensor in unflatten(flat, bucket):
                        params[name].copy_(tensor)
        result = evaluate(self.eval_engine, self.tokenizer, self.eval_records, self.eval_ids, self.cfg)
        self.evals.append((self.step, result["eval/acc"]))
        self.bus.r.hset(self.bus.keys.run_info, mapping={"eval_history": json.dumps(self.evals)})
        log.info("eval at step %d: avg@%d = %.3f", self.step, self.cfg.eval.samples_per_problem, result["eval/acc"])
        return result

    # --- end of run ---------------------------------------------------------------------------
    def drain(self, timeout_s: float = 120.0) -> None:
        """Stop issuing and account for every job still in flight (counted `stale`)."""
        self.set_state("draining")
        keys, deadline = self.bus.keys, time.monotonic() + timeout_s
        drainer = StreamBus(self.bus.r, keys, consumer=f"{self.inst}-drain")
        for entry_id, _ in drainer.read(keys.prompts, count=1_000_000, block_ms=1):  # undelivered jobs
            drainer.hop(keys.prompts, entry_id, outcome=LEDGER_STALE)
        while time.monotonic() < deadline:
            for entry_id, _ in self.bus.read(keys.train, count=1000, block_ms=100):
                self.bus.hop(keys.train, entry_id, outcome=LEDGER_STALE)
            if self.bus.ledger().in_flight == 0:
                break
            self.publisher.catch_up()  # a replica waiting for weights must not hold jobs forever
        log.info("drained: %s", self.bus.ledger().as_dict())

    def save_final(self) -> Path:
        out = Path(self.cfg.output_dir) / "final_model"
        self.eval_engine.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out


def _share(obj: Any, rank: int) -> Any:
    """Rank 0's object to every rank (the learner's own trusted group, not the wire)."""
    box = [obj if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def train(cfg: DapoConfig, coord: Coordinator | None, trainer: Trainer, rank: int) -> None:
    """The step loop, run by every rank; `coord` is None except on rank 0."""
    layout = trainer.param_shapes()
    base_eval: dict[str, float] = {}
    named = trainer.named_full_params()
    if coord is not None:
        coord.publisher.stage(0, named, layout)
        base_eval = coord.run_eval()
        coord.bus.r.hset(coord.bus.keys.run_info, mapping={"base_eval_acc": base_eval.get("eval/acc", -1.0)})
    else:
        for _ in named:
            pass
    for step in range(1, cfg.learner.total_steps + 1):
        picked = coord.collect() if coord is not None else None
        groups = _share([g for _, g in picked] if picked is not None else None, rank)
        if not groups or len(groups) < cfg.algorithm.train_batch_groups:
            break  # stopping
        t0 = time.monotonic()
        if coord is not None:
            coord.step = step
            coord.set_state("training")
        batch = build_batch(groups, pad_id=0, norm_by_std=cfg.algorithm.norm_by_std, overlong_filter=cfg.reward.overlong.filter)
        version = coord.version if coord is not None else step - 1
        metrics = trainer.train_step(batch, learner_version=version)
        t1 = time.monotonic()
        named = trainer.named_full_params()
        if coord is None:
            for _ in named:
                pass
            continue
        coord.set_state("broadcasting")
        rollout_metrics = coord.rollout_metrics(groups)  # lags against the version that trained them
        coord.version += 1
        coord.publisher.stage(coord.version, named, layout)
        coord.bus.r.set(coord.bus.keys.policy_version, coord.version)
        coord.publisher.publish()
        for entry_id, _ in picked or []:
            coord.bus.hop(coord.bus.keys.train, entry_id, outcome=LEDGER_TRAINED)
        metrics.update(rollout_metrics)
        metrics.update({"timing/train_s": t1 - t0, "timing/sync_s": coord.publisher.last_sync_s,
                        "timing/learner_idle_fraction": coord.wait_s / (time.monotonic() - coord.started)})
        every = cfg.eval.every_steps
        if every and step % every == 0 and step != cfg.learner.total_steps:
            metrics.update(coord.run_eval())
        coord.report(metrics)


def main(cfg: DapoConfig) -> int:
    stop = StopFlag().install()
    rank, world, backend = init_distributed(cfg)
    torch.manual_seed(cfg.learner.seed + rank)
    trainer = Trainer(cfg, rank=rank, world_size=world, backend=backend)
    coord = Coordinator(cfg, trainer, backend, stop) if rank == 0 else None
    try:
        train(cfg, coord, trainer, rank)
        if coord is not None:
            final = coord.run_eval()
            coord.drain()
            wall = time.monotonic() - coord.started
            coord.bus.r.hset(coord.bus.keys.run_info, mapping={
                "final_eval_acc": final.get("eval/acc", -1.0), "steps": coord.step, "policy_version": coord.version,
                "learner_idle_fraction": coord.wait_s / wall, "learner_wall_s": wall,
                "mean_version_lag": sum(coord.lags) / len(coord.lags) if coord.lags else 0.0,
                "final_model": str(coord.save_final()), "finished": 1,
            })
            coord.set_state("finished")
    finally:
        if coord is not None:
            coord.hb.stop()
        dist.destroy_process_group()
    return 0
