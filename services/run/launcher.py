"""`dapo run`: the whole system on one machine, every service its own OS process.

Prepares what the config asks for (`services.data.prepare`: synthetic data, the tiny base model,
or the download of an `hf://` model into the Hugging Face cache, once, so that no service
downloads), starts an embedded redis-server when no URL is configured, then the learner (under
torchrun when `learner.nproc > 1`), the gatekeeper, a reward worker and `rollout.replicas`
rollout replicas, exactly as docker-compose or Kubernetes would start them. It supervises them
(`services.run.supervisor`: a service that dies is restarted with back-off, a bounded number of
times), shows a live progress line, stops everything cleanly at the end or on Ctrl-C, and writes
`<output_dir>/summary.json` (`services.run.progress`).

The services' output goes to their log files under `<output_dir>/logs`, never to this console;
the console shows this process's own log lines, each once, and the progress line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.bus import StreamBus, open_bus
from contracts.bus.roles import Role
from contracts.config import REDIS_URL_ENV, DapoConfig, dump_config
from contracts.keys import RunField
from contracts.runtime import CHECKPOINT_REFUSED_FILE
from contracts.signing import KEY_ENV as WEIGHTS_KEY_ENV
from contracts.signing import PUBLIC_KEY_ENV as WEIGHTS_PUBLIC_KEY_ENV
from contracts.signing import new_weights_key, public_key_text, weights_public_key
from contracts.weight_sync import HOST_ENV as WEIGHTS_HOST_ENV
from reward.service import check_reward_function
from rollout.engine import REPLICA_NAME_ENV
from rollout.tool_use import check_tools
from services.data.prepare import prepare
from services.experiments.plots import write_curves_svg
from services.planning.capacity import ModelShape, budget
from services.planning.placement import count_gpus, gpu_memory_of_this_machine, plan
from services.run.progress import Progress, report, run_end, write_outputs
from services.run.supervisor import (
    Service,
    run_finished,
    service_role,
    services_to_start,
    stop_all,
    supervise,
)

if TYPE_CHECKING:
    from services.run.redis_server import RedisServer

log = logging.getLogger(__name__)


def run_local(
    cfg: DapoConfig,
    *,
    resume: bool = False,
    quiet: bool = False,
    gpus: int | None = None,
    dry_run: bool = False,
    model_config: str | None = None,
    gpu_memory_gib: float | None = None,
    allow_redis6: bool = False,
) -> int:
    """Run everything on this machine. `gpus` overrides the GPU count (plans for other machines);
    `dry_run` prints the placement and the per-GPU memory budget and starts nothing;
    `allow_redis6` accepts an embedded Redis 6 (`services.run.redis_server` says what it risks)."""
    placement = plan(cfg, count_gpus() if gpus is None else gpus)  # refuses what does not fit
    if dry_run:
        budget = _budget_text(cfg, model_config, gpu_memory_gib)
        sys.stdout.write(f"{placement.describe()}\n{budget}\n")
        return 0
    _check_before_start(cfg)
    keys = _weight_keys()
    started = time.monotonic()
    out = Path(cfg.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    prepared = prepare(cfg)
    cfg = prepared.cfg  # model.path: a local directory from here on
    config_path = _write_service_config(cfg, out)
    server, url = _start_redis(cfg, out, allow_redis6)
    env = _shared_env(prepared.env, url)
    bus = _open_run(cfg, url, resume, keys)
    from contracts.runtime import free_port

    api_port = cfg.api.port or free_port()
    services = services_to_start(cfg, config_path, out / "logs", api_port)
    _give_credentials(services, keys, server)
    if placement.gpus:
        for svc in services:
            svc.devices = placement.visible_devices(svc.name)
    refused = out / CHECKPOINT_REFUSED_FILE  # left by a learner that refused its checkpoint
    refused.unlink(missing_ok=True)
    learner = services[0]
    interrupted = False
    with _stop_signals() as stop:
        progress = Progress(bus, cfg.learner.total_steps, quiet)
        try:
            for svc in services:
                svc.start(env)
            sys.stderr.write(f"dashboard and REST API: http://{cfg.api.host}:{api_port}/\n")
            interrupted = supervise(services, env, bus, refused, progress.show, stop)
        finally:
            progress.close()
            learner_rc = learner.proc.poll() if learner.proc else None
            finished = run_finished(bus)
            stop_all(services, learner_first=interrupted)
            summary = write_outputs(
                cfg, bus, services, prepared, time.monotonic() - started, placement.gpus
            )
            summary |= run_end(learner_rc, interrupted, refused)
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            write_curves_svg(summary, out / "curves.svg")
            bus.close()
            if server is not None:
                server.stop()
    report(cfg, summary, out)
    return 0 if learner_rc == 0 and finished and not interrupted else 1


# --- the steps of run_local -------------------------------------------------------------------
def _check_before_start(cfg: DapoConfig) -> None:
    """What would fail a service later fails before anything starts: a reward function or a
    tool that cannot be loaded, an API token too weak to serve."""
    from services.api.app import check_token_strength

    check_reward_function(cfg)
    check_tools(cfg.rollout.tools)
    check_token_strength(cfg.api.token_env)


def _weight_keys() -> tuple[str, str]:
    """The weight-sync key pair (private, public): the caller's, so replicas started by hand can
    join, else a fresh one for this run. A malformed key is refused here."""
    private = os.environ.get(WEIGHTS_KEY_ENV) or new_weights_key()[0]
    return private, public_key_text(private)


def _write_service_config(cfg: DapoConfig, out: Path) -> Path:
    """The config every service reads. The services read the Redis URL (and its credentials)
    from their environment, never from a file: the config they are given has none."""
    path = out / "config.yaml"
    queue = cfg.queue.model_copy(update={"redis_url": None})
    path.write_text(dump_config(cfg.model_copy(update={"queue": queue})))
    return path


def _start_redis(cfg: DapoConfig, out: Path, allow_redis6: bool) -> tuple[RedisServer | None, str]:
    """(the embedded server, None with a configured URL; the supervisor's URL). The embedded
    server declares a Redis user per role (contracts.bus.roles); each service gets its own
    role's URL (`_give_credentials`), and the supervisor connects as the operator."""
    if cfg.redis_url is not None:
        return None, cfg.redis_url
    from services.run.redis_server import RedisServer

    server = RedisServer(
        out / "redis",
        appendonly=True,
        password=secrets.token_urlsafe(24),
        roles={role: secrets.token_urlsafe(24) for role in Role},
        namespace=cfg.queue.namespace,
        allow_redis6=allow_redis6 or None,  # else DAPO_ALLOW_REDIS6 decides
    ).start()
    return server, server.role_url(Role.OPERATOR)


def _shared_env(prepared: dict[str, str], url: str) -> dict[str, str]:
    """The environment every service starts with; each adds what is its own alone."""
    env = {**os.environ, **prepared, REDIS_URL_ENV: url, "PYTHONUNBUFFERED": "1"}
    for name in [n for n in env if n.startswith(f"{REDIS_URL_ENV}_")]:
        del env[name]  # a role's URL left in the caller's shell would outrank the run's own
    for name in (WEIGHTS_KEY_ENV, WEIGHTS_PUBLIC_KEY_ENV):
        env.pop(name, None)  # given to the learner and the replicas only (_give_credentials)
    return env


def _open_run(cfg: DapoConfig, url: str, resume: bool, keys: tuple[str, str]) -> StreamBus:
    """The supervisor's bus on a fresh run (namespace cleared, old checkpoints set aside) or a
    resumed one. It must keep supervising while Redis is full: its writes fail, not pause."""
    bus = open_bus(url, cfg.queue.namespace, "launcher", pause_when_full=False)
    bus.check_memory_policy()
    if not resume:
        bus.clear_namespace()
        _set_aside_checkpoints(cfg.checkpoint_dir)
    bus.clear_run_field(RunField.FINISHED)  # a resumed run is not finished until it says so
    bus.ensure_groups()
    if resume:
        _retire_earlier_jobs(bus, keys)
    return bus


def _retire_earlier_jobs(bus: StreamBus, keys: tuple[str, str]) -> None:
    """A run resumed under another learner key (a fresh one each `dapo run` without
    DAPO_WEIGHTS_KEY) finds its earlier jobs signed by a key nobody holds now: every service
    would refuse them as foreign and the ledger never balance. Dead-letter them as the run's own,
    counted, before anything starts; the learner issues new jobs in their place."""
    public = weights_public_key({WEIGHTS_PUBLIC_KEY_ENV: keys[1]})
    reason = "resumed under another learner key: its job is signed by the run's earlier one"
    if retired := bus.as_consumer("launcher-resume").retire_unsigned(public, reason):
        log.warning(
            "%d jobs of the run's earlier incarnation were signed by another key: dead-lettered "
            "(set %s to keep a run's key across --resume)",
            retired,
            WEIGHTS_KEY_ENV,
        )


def _give_credentials(
    services: list[Service], keys: tuple[str, str], server: RedisServer | None
) -> None:
    """Each service's own secrets: the learner the private weight key; the replicas, reward
    workers and gatekeeper the public one (announcements, jobs, dead letters); the replicas the
    learner's host they pin and the name their seed follows; each its role's Redis URL."""
    private, public = keys
    for svc in services:
        if svc.name == "learner":
            svc.private_env[WEIGHTS_KEY_ENV] = private
        if svc.name.startswith(("rollout", "reward", "gatekeeper")):
            svc.private_env[WEIGHTS_PUBLIC_KEY_ENV] = public
        if svc.name.startswith("rollout"):
            # Pinned: an announcement naming any other host than the learner's is refused.
            svc.private_env[WEIGHTS_HOST_ENV] = os.environ.get(WEIGHTS_HOST_ENV) or "127.0.0.1"
            svc.private_env[REPLICA_NAME_ENV] = svc.name  # its seed survives a restart
        if server is not None:
            svc.private_env[REDIS_URL_ENV] = server.role_url(service_role(svc.name))


@contextlib.contextmanager
def _stop_signals() -> Iterator[threading.Event]:
    """An event SIGINT and SIGTERM set while the block runs (the run then stops every service,
    learner first); the previous handlers come back after."""
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _budget_text(cfg: DapoConfig, model_config: str | None, gpu_memory_gib: float | None) -> str:
    shape_file = Path(model_config) if model_config else Path(cfg.model.path) / "config.json"
    if not shape_file.exists():
        return f"no model config at {shape_file}: pass --model-config FILE for the memory budget"
    gib = gpu_memory_gib or gpu_memory_of_this_machine() or 80.0
    return budget(cfg, ModelShape.from_file(shape_file), gib).describe(gib)


def _set_aside_checkpoints(store: Path) -> None:
    """A fresh run must not resume an earlier run's checkpoints: move them aside, never delete."""
    if store.is_dir() and any(store.iterdir()):
        aside = store.with_name(f"{store.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        store.rename(aside)
        log.warning(
            "moved the earlier run's checkpoints to %s (use --resume to continue a run)", aside
        )
