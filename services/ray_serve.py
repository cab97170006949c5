"""Ray Serve hosting for the rollout and reward stages: `serve run services.ray_serve:app`.

Each Serve replica hosts one stage handler, built by the same factory as `dapo rollout` /
`dapo reward` (`rollout.service.build_replica`, `reward.service.build_stage`), and the work
still flows through the Redis streams: Serve only places, counts, health-checks and restarts
the processes. No prompt or group travels as a Serve request; the HTTP/handle `__call__` only
reports status.

How a Serve replica differs from the CLI process:

- The worker loop runs on a background thread started in `__init__`. Serve runs user code off
  the main thread and owns the replica's signals, so the `StopFlag` is never installed; Serve's
  shutdown calls `__del__`, which sets the flag and joins the thread. As on SIGTERM, the current
  batch finishes (or its jobs are handed back) and the final stats are written. The join has no
  timeout of its own: `graceful_shutdown_timeout_s` is the bound, after which Serve kills the
  replica and its pending entries are taken over by the other replicas once its heartbeat is
  gone (two `queue.heartbeat_ttl_s`; at-least-once, as for any dead stage).
- `check_health` raises once the worker thread has exited, so Serve replaces the replica.
- Serve's default autoscaler counts HTTP requests in flight, which these deployments never
  receive. `BacklogPolicy` scales rollout replicas on the prompts stream's depth instead, which
  every replica reports through `record_autoscaling_stats`.
- Rollout replicas receive weights from the learner over the torch.distributed side group as
  before (a replica is a plain process): the learner's `DAPO_WEIGHTS_HOST` must be reachable from
  every Ray node, and the learner finds replicas by their heartbeats, not through Serve. They
  take only announcements that `DAPO_WEIGHTS_PUBLIC_KEY` (the learner's public key) verifies,
  which must be in the Ray nodes' environment (a rollout deployment without it fails in its
  constructor, naming it).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingContext
from ray.serve.handle import DeploymentHandle

from contracts.config import ConfigError, load_config
from contracts.model_source import with_local_model
from contracts.runtime import StageHandler, serve_stage, service_context

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 60.0
"""Serve's deadline for `__del__`: one rollout batch of the CPU demo takes seconds. Raise it in
serve.yaml (`deployments[].graceful_shutdown_timeout_s`) for long generations on GPU."""
BACKLOG_METRIC = "prompt_backlog"


class WorkerDied(RuntimeError):
    """The stage worker's thread has exited; Serve's health check then replaces the replica."""


class _StageHost:
    """One stage worker on a background thread of this process, run by the same skeleton as the
    CLI process (`serve_stage`: heartbeat, the stage loop, final stats, release).

    Subclasses build the worker (a `StageHandler`) in `setup`.
    """

    role = ""
    """Heartbeat role (`rollout`, `reward`): the same as the CLI service's, so the learner, the
    API and `dapo status` see a Serve replica exactly like a `dapo rollout` process."""

    def __init__(self, config: str, overrides: list[str] | None = None) -> None:
        from services.logs import setup_logging

        setup_logging(self.role)
        # An hf:// model: its snapshot in the Hugging Face cache, as `dapo rollout` resolves it.
        self.cfg = with_local_model(load_config(config, list(overrides or [])))
        # Signal handlers need the main thread, which Serve owns: the StopFlag is not installed.
        self.ctx = service_context(self.cfg, self.role, install_signals=False)
        self.id, self.stop, self.bus = self.ctx.inst, self.ctx.stop, self.ctx.bus
        self.error: BaseException | None = None
        self._stopped = False
        self.worker = self.setup()
        # Beating before __init__ returns: Serve calls the replica ready then, and the learner
        # and `dapo status` count replicas by their heartbeats. `serve_stage` stops it.
        self.ctx.heartbeat(self.cfg.queue.heartbeat_ttl_s, self.worker.status)
        self.thread = threading.Thread(target=self._run, name=f"{self.role}-worker", daemon=True)
        self.thread.start()
        log.info("%s replica %s ready", self.role, self.id)

    def setup(self) -> StageHandler:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            serve_stage(self.ctx, self.worker, self.cfg.queue)
        except BaseException as exc:  # the thread's boundary: kept for check_health to surface
            log.exception("%s worker %s died", self.role, self.id)
            self.error = exc
        log.info("%s replica %s stopped: %s", self.role, self.id, self.worker.status())

    # --- what Serve calls ----------------------------------------------------------------------
    def __call__(self, request: object = None) -> dict[str, Any]:
        """This replica's status (HTTP answers it as JSON)."""
        return {
            "role": self.role,
            "id": self.id,
            "alive": self.thread.is_alive(),
            **self.worker.status(),
        }

    def check_health(self) -> None:
        if not self.thread.is_alive() and not self.stop.stopping:
            raise WorkerDied(f"{self.role} worker {self.id} exited: {self.error!r}")

    def __del__(self) -> None:
        # Serve calls this on replica shutdown, and the garbage collector may call it again; a
        # constructor that failed part-way leaves no thread to stop.
        thread: threading.Thread | None = getattr(self, "thread", None)
        if thread is None or self._stopped:
            return
        self._stopped = True
        self.stop.event.set()
        while thread.is_alive():
            thread.join(5.0)
            if thread.is_alive():
                log.info("%s %s: finishing the current batch before exiting", self.role, self.id)


class RolloutHost(_StageHost):
    """`dapo rollout` as a Serve replica: prompt jobs -> G responses with behaviour log-probs."""

    role = "rollout"

    def setup(self) -> StageHandler:
        from rollout.service import build_replica

        return build_replica(self.cfg, self.ctx)  # as `dapo rollout` builds it

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For `BacklogPolicy`: jobs waiting or being generated (acked entries are deleted, so
        XLEN is exactly that). Every replica reports the same stream."""
        prompts = self.bus.keys.prompts  # the one stream this role reads besides its own
        return {BACKLOG_METRIC: float(self.bus.depths((prompts,))[prompts.group])}


class RewardHost(_StageHost):
    """`dapo reward` as a Serve replica: verifier score + overlong shaping per response."""

    role = "reward"

    def setup(self) -> StageHandler:
        from reward.service import build_stage

        return build_stage(self.cfg, self.ctx)  # as `dapo reward` builds it


class StatusIngress:
    """The application's ingress: one replica's status per stage. Every instance's status (Serve
    replica or CLI process) is in its heartbeat, which `dapo status` and the API list."""

    def __init__(self, rollout: DeploymentHandle[Any], reward: DeploymentHandle[Any]) -> None:
        self.rollout, self.reward = rollout, reward

    async def __call__(self, request: object = None) -> dict[str, Any]:
        return {"rollout": await self.rollout.remote(), "reward": await self.reward.remote()}


# Status calls are the only requests; the work arrives through Redis.
_STAGE_OPTIONS: dict[str, Any] = {
    "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
    "max_ongoing_requests": 8,
}
RolloutDeployment = serve.deployment(
    name="RolloutReplica", ray_actor_options={"num_cpus": 1}, **_STAGE_OPTIONS
)(RolloutHost)
RewardDeployment = serve.deployment(
    name="RewardReplica", ray_actor_options={"num_cpus": 1}, **_STAGE_OPTIONS
)(RewardHost)
StatusDeployment = serve.deployment(
    name="PipelineStatus", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16
)(StatusIngress)


class BacklogPolicy:
    """Serve autoscaling policy: enough rollout replicas for the prompt backlog.

    desired = ceil(backlog / target_backlog_per_replica); Serve then applies the deployment's
    min/max replicas, up/down-scaling factors and delays. The backlog is bounded by the learner's
    admission control (at most (max_staleness + 1) x train_batch_groups x oversampling jobs in
    flight), so max_replicas should be chosen against that bound. It does NOT see the reward stage:
    scale reward replicas by count.
    """

    def __init__(self, target_backlog_per_replica: float = 16.0) -> None:
        if target_backlog_per_replica <= 0:
            raise ValueError(f"target_backlog_per_replica={target_backlog_per_replica} must be > 0")
        self.target = target_backlog_per_replica

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        by_replica = (ctx.aggregated_metrics or {}).get(BACKLOG_METRIC) or {}
        if not by_replica:  # no report yet (replicas starting): hold
            return ctx.target_num_replicas, {}
        backlog = max(by_replica.values())
        return math.ceil(backlog / self.target), {}


class ServeArgs(BaseModel):
    """The builder's arguments (`args:` in serve.yaml, or `key=value` after `serve run`)."""

    model_config = ConfigDict(extra="forbid")

    config: str
    """The run's YAML file, as for `dapo rollout --config`. Relative paths (here and inside the
    file) resolve against the replicas' working directory: run from the repository root."""
    overrides: list[str] = Field(default_factory=list)
    """Dotted overrides (`rollout.group_size=8`); a string is split on whitespace."""
    rollout_replicas: PositiveInt | None = None
    """Fixed rollout replica count (None = the config's `rollout.replicas`)."""
    rollout_autoscaling: dict[str, Any] | None = None
    """A Serve `autoscaling_config` for rollout instead of a fixed count; without a `policy`,
    `BacklogPolicy` is used (Serve's default scales on requests, which never come)."""
    reward_replicas: PositiveInt = 1
    rollout_gpu: bool = False
    """Give each rollout replica `rollout.tensor_parallel_size` GPUs (vLLM on CUDA)."""
    rollout_cpus: PositiveFloat = 1.0
    reward_cpus: PositiveFloat = 1.0

    @field_validator("overrides", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return value.split() if isinstance(value, str) else value


def app(args: dict[str, Any]) -> Application:
    """Application builder: `import_path: services.ray_serve:app` with `args` as in `ServeArgs`.

    The config is loaded here too, so a bad file or override fails the deploy, not each replica.
    """
    try:
        a = ServeArgs.model_validate(args)
    except ValidationError as exc:
        raise ConfigError(f"services.ray_serve:app args: {exc}") from None
    cfg = load_config(a.config, a.overrides)
    if a.rollout_autoscaling is not None and a.rollout_replicas is not None:
        raise ConfigError("give rollout_replicas or rollout_autoscaling, not both")
    num_gpus = cfg.rollout.tensor_parallel_size if a.rollout_gpu else 0
    rollout_opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": a.rollout_cpus, "num_gpus": num_gpus}
    }
    if a.rollout_autoscaling is not None:
        scaling = dict(a.rollout_autoscaling)
        scaling.setdefault("policy", {"policy_function": f"{__name__}:BacklogPolicy"})
        rollout_opts["autoscaling_config"] = scaling
    else:
        rollout_opts["num_replicas"] = a.rollout_replicas or cfg.rollout.replicas
    rollout = RolloutDeployment.options(**rollout_opts).bind(a.config, a.overrides)
    reward = RewardDeployment.options(
        num_replicas=a.reward_replicas, ray_actor_options={"num_cpus": a.reward_cpus}
    ).bind(a.config, a.overrides)
    return StatusDeployment.bind(rollout, reward)
