"""The service processes of `dapo run`: which ones start, and keeping them up.

`services_to_start` lists them: the learner (under torchrun when `learner.nproc > 1`), the
gatekeeper, a reward worker, the API and `rollout.replicas` rollout replicas, each
`python -m services.cli <command>` writing to its own log file. A `Service` starts in a session of
its own and dies with the launcher, even one killed outright. `supervise` keeps them up until the
learner is done: a service that dies is restarted with exponential back-off, at most
`MAX_RESTARTS` times, as a container orchestrator would; `stop_all` stops them, learner first
when the run was interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import redis

from contracts.bus import StreamBus
from contracts.bus.roles import Role
from contracts.config import DapoConfig
from contracts.keys import RunField, restarts_counter
from contracts.runtime import instance_id
from sandbox.confine import term_with_parent

log = logging.getLogger(__name__)

MAX_RESTARTS = 3


@dataclass
class Service:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    log_file: TextIO | None = field(default=None, repr=False)
    devices: str | None = None
    """CUDA_VISIBLE_DEVICES for this service (None: inherit; "" hides every GPU)."""
    private_env: dict[str, str] = field(default_factory=dict, repr=False)
    """Environment only this service gets (the weight-sync key: the learner and the replicas)."""

    def start(self, env: dict[str, str]) -> None:
        self.log_file = self.log_path.open("a")
        env = {**env, **self.private_env}
        if self.devices is not None:
            env = {**env, "CUDA_VISIBLE_DEVICES": self.devices}
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=term_with_parent,  # a launcher killed outright takes its services along
        )
        log.info("started %s (pid %d), log %s", self.name, self.proc.pid, self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # torchrun's workers live in the same session

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False


def service_role(name: str) -> Role:
    """The Redis user of a service `dapo run` starts: `rollout-1` is a rollout replica."""
    return Role(name.split("-", 1)[0])


def services_to_start(
    cfg: DapoConfig, config_path: Path, logs: Path, api_port: int
) -> list[Service]:
    """Every process of the run, the learner first: `supervise` and `stop_all` treat
    `services[0]` as the learner."""
    py = sys.executable
    cli = [py, "-m", "services.cli"]
    conf = ["--config", str(config_path)]
    if cfg.learner.nproc > 1:
        learner = [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={cfg.learner.nproc}",
            "-m",
            "services.cli",
            "learner",
            *conf,
        ]
    else:
        learner = [*cli, "learner", *conf]
    out = [
        Service("learner", learner, logs / "learner.log"),
        Service("gatekeeper", [*cli, "gatekeeper", *conf], logs / "gatekeeper.log"),
    ]
    out.append(Service("reward-0", [*cli, "reward", *conf], logs / "reward-0.log"))
    out.append(Service("api", [*cli, "api", *conf, "--port", str(api_port)], logs / "api.log"))
    out += [
        Service(f"rollout-{i}", [*cli, "rollout", *conf], logs / f"rollout-{i}.log")
        for i in range(cfg.rollout.replicas)
    ]
    return out


def supervise(
    services: list[Service],
    env: dict[str, str],
    bus: StreamBus,
    refused: Path,
    show_progress: Callable[[], None],
    stop: threading.Event,
) -> bool:
    """Keep the services up until the learner is done (finished, out of restarts, or it refused
    its checkpoint) or a signal asks to stop (returns True: interrupted). A crashed learner, or
    one stopped from outside (SIGTERM: it exits 0 after checkpointing), resumes from the newest
    committed checkpoint. `show_progress` is called once a poll (the console's progress line)."""
    learner = services[0]
    while not stop.is_set():
        if not learner.alive():
            if run_finished(bus) or learner.restarts >= MAX_RESTARTS or refused.exists():
                return False
            _restart(learner, env, bus)
        for svc in services[1:]:
            if not svc.alive():
                _restart(svc, env, bus)
        show_progress()
        time.sleep(1.0)
    log.warning("interrupted: stopping every service")
    return True


def run_finished(bus: StreamBus, attempts: int = 3) -> bool:
    """The learner records `finished` when it completed total_steps (not when merely stopped)."""
    for attempt in range(attempts):
        try:
            return bus.run_field(RunField.FINISHED) == "1"
        except redis.RedisError as exc:
            log.warning("could not read whether the run finished (%s)", exc)
            time.sleep(1.0 + attempt)
    return False


def _restart(svc: Service, env: dict[str, str], bus: StreamBus) -> None:
    """Bounded restarts with exponential back-off, like a container orchestrator's."""
    rc = svc.proc.returncode if svc.proc else None
    if svc.restarts >= MAX_RESTARTS:
        return
    svc.restarts += 1
    with contextlib.suppress(redis.RedisError):
        bus.incr(restarts_counter(svc.name))  # visible in /status and /metrics
        if svc.proc is not None:
            # A killed process leaves its heartbeat until the TTL runs out, and until then the
            # learner would still count it as a replica (and wait for it to join a weight sync).
            # The supervisor knows it is gone, so it says so at once.
            role = svc.name.split("-")[0]
            bus.drop_heartbeat(role, instance_id(role, pid=svc.proc.pid))
    if svc.log_file:
        svc.log_file.close()
    delay = min(2.0**svc.restarts, 30.0)
    log.warning(
        "%s exited with %s; restart %d/%d in %.0fs", svc.name, rc, svc.restarts, MAX_RESTARTS, delay
    )
    time.sleep(delay)
    svc.start(env)


def stop_all(services: list[Service], *, learner_first: bool, grace_s: float = 30.0) -> None:
    order = services if learner_first else services[1:]
    for svc in order:
        svc.signal(signal.SIGTERM)
    for svc in order:
        if not svc.wait(grace_s):
            log.warning("%s did not stop within %.0fs; killing it", svc.name, grace_s)
            svc.signal(signal.SIGKILL)
            svc.wait(5)
    for svc in services:
        if svc.log_file:
            svc.log_file.close()
