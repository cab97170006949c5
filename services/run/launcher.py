"""`dapo run`: the whole system on one machine, every service its own OS process.

Prepares what the config asks for (`services.data.prepare`: synthetic data, the tiny base model,
or the download of an `hf://` model into the Hugging Face cache, once, so that no service
downloads), starts an embedded redis-server when no URL is configured, then the learner (under
torchrun when `learner.nproc > 1`), the gatekeeper, a reward worker and `rollout.replicas`
rollout replicas, exactly as docker-compose or Kubernetes would start them. It supervises them
(a service that dies is restarted with back-off, a bounded number of times), shows a live
progress line, stops everything cleanly at the end or on Ctrl-C, and writes
`<output_dir>/summary.json`.

The services' output goes to their log files under `<output_dir>/logs`, never to this console;
the console shows this process's own log lines, each once, and the progress line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import redis
from tqdm import tqdm

from contracts.bus import StreamBus, open_bus
from contracts.bus.roles import Role
from contracts.config import REDIS_URL_ENV, DapoConfig, dump_config
from contracts.keys import Counter, RunField, restarts_counter
from contracts.runtime import CHECKPOINT_REFUSED_FILE, instance_id
from contracts.signing import KEY_ENV as WEIGHTS_KEY_ENV
from contracts.signing import PUBLIC_KEY_ENV as WEIGHTS_PUBLIC_KEY_ENV
from contracts.signing import new_weights_key, public_key_text
from contracts.weight_sync import HOST_ENV as WEIGHTS_HOST_ENV
from reward.service import check_reward_function
from rollout.engine import REPLICA_NAME_ENV
from rollout.tool_use import check_tools
from sandbox.confine import term_with_parent
from services.api.task_status import task_section
from services.data.prepare import Prepared, prepare
from services.experiments.plots import write_curves_svg
from services.planning.capacity import ModelShape, budget
from services.planning.placement import count_gpus, gpu_memory_of_this_machine, plan

if TYPE_CHECKING:
    from services.run.redis_server import RedisServer

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
RATE_WINDOW_S = 120.0
"""The progress line's steps/s is measured over the steps of about the last two minutes."""


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


class Progress:
    """One live line: step, pace (steps/s and the time left, as tqdm formats them), reward, eval
    accuracy, pass rate, version lag, ledger. On a terminal it is redrawn in place every poll,
    otherwise written as a new line every 10 s; `quiet` writes nothing.

    The pace counts training steps only: the time left leaves out the final evaluation and the
    drain at the end of the run. It is measured between steps, so a pause (or a stalled learner)
    shows only when the next step comes, as a slower rate."""

    def __init__(
        self,
        bus: StreamBus,
        total_steps: int,
        quiet: bool,
        *,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
    ) -> None:
        self.bus, self.total, self.quiet, self.clock = bus, total_steps, quiet, clock
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last_print = -float("inf")
        self.last_step: int | None = None
        self.seen: deque[tuple[float, int]] = deque()
        """(when first seen, step) of the steps reached while watching, within about
        RATE_WINDOW_S, oldest first. The step shown at start is not among them: the time before
        the next one holds start-up and the base evaluation, not a training step."""

    def line(self) -> str:
        state = self.bus.learner_state()
        m = self.bus.last_metrics()
        evals = self.bus.eval_history()
        acc = f"{evals[-1][1]:.3f}" if evals else "-"
        led = self.bus.ledger()
        raw = state.get("step", "0")
        step = int(raw) if raw.isdigit() else 0  # Redis values are parsed defensively
        return (
            f"step {step}/{self.total} [{state.get('state', 'starting')}] {self.pace(step)} "
            f"reward {m.get('critic/rewards/mean', float('nan')):.3f} "
            f"acc {m.get('rollout/acc_mean', float('nan')):.3f} "
            f"eval {acc} pass {m.get('gate/pass_rate', float('nan')):.2f} "
            f"lag {m.get('rollout/version_lag_mean', float('nan')):.2f} "
            f"| issued {led.issued} trained {led.trained} filtered {led.filtered} "
            f"stale {led.stale} evaluated {led.evaluated}/{led.eval_issued} "
            f"in-flight {led.in_flight}"
        )

    def pace(self, step: int) -> str:
        """`1.52step/s eta 03:07` (`12.40s/step` when slower than a step a second), measured
        between the steps reached in about the last RATE_WINDOW_S; `?step/s eta ?` until two
        steps were reached while watching."""
        now = self.clock()
        last, self.last_step = self.last_step, step
        if last is not None and step < last:  # an operator restore went back: measure afresh
            self.seen.clear()
        elif last is not None and step > last:
            self.seen.append((now, step))
        while len(self.seen) > 2 and now - self.seen[1][0] > RATE_WINDOW_S:
            self.seen.popleft()
        if len(self.seen) < 2:
            return "?step/s eta ?"
        (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
        if t1 <= t0:
            return "?step/s eta ?"
        pace = tqdm.format_meter(
            s1,
            self.total,
            t1 - t0,
            unit="step",
            rate=(s1 - s0) / (t1 - t0),
            bar_format="{rate_fmt} eta {remaining}",
        )
        return str(pace).strip()

    def show(self) -> None:
        if self.quiet:
            return
        now = self.clock()
        try:
            text = self.line()
        except redis.RedisError:
            return
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
        elif now - self.last_print > 10:
            self.stream.write(text + "\n")
            self.last_print = now

    def close(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")


def service_role(name: str) -> Role:
    """The Redis user of a service `dapo run` starts: `rollout-1` is a rollout replica."""
    return Role(name.split("-", 1)[0])


def _services(cfg: DapoConfig, config_path: Path, logs: Path, api_port: int) -> list[Service]:
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


def _stat(stats: dict[str, Any], name: str, default: float) -> float:
    """A number from an instance's final stats; anything else
    (a planted value) reads as `default`."""
    value = stats.get(name, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else default


def summarize(
    cfg: DapoConfig,
    bus: StreamBus,
    wall_s: float,
    services: list[Service],
    eval_set: dict[str, Any] | None = None,
) -> dict[str, Any]:
    info = bus.run_info()
    finals = bus.final_stats("rollout")
    rollout_idle = [_stat(s, "idle_fraction", 0.0) for s in finals.values()]
    replica_versions = {rid: int(_stat(s, "policy_version", -1)) for rid, s in finals.items()}
    counters = bus.counters()
    metrics = bus.recent_metrics()
    ledger = bus.ledger()

    def num(name: RunField, default: float = float("nan")) -> float:
        try:
            return float(info[name]) if name in info else default
        except ValueError:
            return default

    return {
        "run_name": cfg.run_name,
        "base_eval_acc": num(RunField.BASE_EVAL_ACC),
        "final_eval_acc": num(RunField.FINAL_EVAL_ACC),
        "steps": int(num(RunField.STEPS, 0)),
        "policy_version": int(num(RunField.POLICY_VERSION, 0)),
        "wall_seconds": round(wall_s, 1),
        "ledger": ledger.as_dict(),
        "mean_version_lag": num(RunField.MEAN_VERSION_LAG),
        "learner_idle_fraction": num(RunField.LEARNER_IDLE_FRACTION),
        "rollout_idle_fraction": sum(rollout_idle) / len(rollout_idle)
        if rollout_idle
        else float("nan"),
        "rollout_busy_seconds": round(
            sum(_stat(s, "busy_seconds", 0.0) for s in finals.values()), 2
        ),
        "replica_final_versions": replica_versions,
        "gatekeeper_pass_rate": bus.pass_rate(ledger.filtered),
        "generated_per_trained": (ledger.trained + ledger.filtered + ledger.stale) / ledger.trained
        if ledger.trained
        else None,
        "prompts_skipped": counters.get(Counter.PROMPTS_SKIPPED, 0),
        "gatekeeper_evaluations": sum(
            int(_stat(s, "evaluations", 0)) for s in bus.final_stats("gatekeeper").values()
        ),
        "eval_history": bus.eval_history(),
        "eval_set": eval_set,
        # Each task's (data_source's) run-long figures and first and last evaluation (issue 42).
        "tasks": task_section(bus.task_stats(), bus.task_eval_history()),
        "counters": counters,
        "restarts": {s.name: s.restarts for s in services if s.restarts},
        "final_model": info.get(RunField.FINAL_MODEL),
        "train_tokens_per_s": sum(m.get("rollout/tokens", 0.0) for m in metrics)
        / max(wall_s, 1e-9),
        "timing": step_timing(metrics),
        "mean_sync_seconds": sum(m.get("timing_s/sync_weights", 0.0) for m in metrics)
        / max(len(metrics), 1),
        "reward_curve": [
            [m["step"], m.get("critic/rewards/mean"), m.get("rollout/acc_mean")] for m in metrics
        ],
    }


def write_metrics_jsonl(bus: StreamBus, path: Path) -> None:
    """Every per-step record of the run (the metrics stream), one JSON object per line: what the
    TensorBoard curves show, readable without TensorBoard (`dapo ablate` and `dapo plan
    --calibrate` read it). Written atomically, so a reader never sees half a file."""
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for record in bus.recent_metrics():
            f.write(json.dumps(record) + "\n")
    tmp.replace(path)


def step_timing(metrics: list[dict[str, Any]], warmup: int = 5) -> dict[str, float]:
    """Steady-state pace of the learner from its per-step records (the first `warmup` steps left
    out): steps per hour by the wall clock, and the mean seconds of a step's parts."""
    steady = [m for m in metrics if m.get("step", 0) > warmup]
    if len(steady) < 2:
        return {}
    span = float(steady[-1]["time"]) - float(steady[0]["time"])

    def mean(key: str) -> float:
        return sum(float(m.get(key, 0.0)) for m in steady) / len(steady)

    return {
        "steps_per_hour": 3600.0 * (len(steady) - 1) / span if span > 0 else 0.0,
        "step_s": mean("timing_s/step"),
        "update_actor_s": mean("timing_s/update_actor"),
        "sync_weights_s": mean("timing_s/sync_weights"),
        "learner_idle_fraction": mean("perf/learner_idle_fraction"),
    }


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
    bus = _open_run(cfg, url, resume)
    from contracts.runtime import free_port

    api_port = cfg.api.port or free_port()
    services = _services(cfg, config_path, out / "logs", api_port)
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
            interrupted = _supervise(services, env, bus, refused, progress, stop)
        finally:
            progress.close()
            learner_rc = learner.proc.poll() if learner.proc else None
            finished = _run_finished(bus)
            _stop_all(services, learner_first=interrupted)
            summary = _write_outputs(
                cfg, bus, services, prepared, time.monotonic() - started, placement.gpus
            )
            summary |= _run_end(learner_rc, interrupted, refused)
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            write_curves_svg(summary, out / "curves.svg")
            bus.close()
            if server is not None:
                server.stop()
    _report(cfg, summary, out)
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


def _open_run(cfg: DapoConfig, url: str, resume: bool) -> StreamBus:
    """The supervisor's bus on a fresh run (namespace cleared, old checkpoints set aside) or a
    resumed one. It must keep supervising while Redis is full: its writes fail, not pause."""
    bus = open_bus(url, cfg.queue.namespace, "launcher", pause_when_full=False)
    bus.check_memory_policy()
    if not resume:
        bus.clear_namespace()
        _set_aside_checkpoints(cfg.checkpoint_dir)
    bus.clear_run_field(RunField.FINISHED)  # a resumed run is not finished until it says so
    bus.ensure_groups()
    return bus


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


def _supervise(
    services: list[Service],
    env: dict[str, str],
    bus: StreamBus,
    refused: Path,
    progress: Progress,
    stop: threading.Event,
) -> bool:
    """Keep the services up until the learner is done (finished, out of restarts, or it refused
    its checkpoint) or a signal asks to stop (returns True: interrupted). A crashed learner, or
    one stopped from outside (SIGTERM: it exits 0 after checkpointing), resumes from the newest
    committed checkpoint."""
    learner = services[0]
    while not stop.is_set():
        if not learner.alive():
            if _run_finished(bus) or learner.restarts >= MAX_RESTARTS or refused.exists():
                return False
            _restart(learner, env, bus)
        for svc in services[1:]:
            if not svc.alive():
                _restart(svc, env, bus)
        progress.show()
        time.sleep(1.0)
    log.warning("interrupted: stopping every service")
    return True


def _write_outputs(
    cfg: DapoConfig,
    bus: StreamBus,
    services: list[Service],
    prepared: Prepared,
    wall_s: float,
    gpus: int,
) -> dict[str, Any]:
    """The run's summary (returned; the caller adds how it ended) and metrics.jsonl."""
    summary = summarize(cfg, bus, wall_s, services, prepared.eval_set)
    write_metrics_jsonl(bus, Path(cfg.output_dir) / "metrics.jsonl")
    # Where the services ran: on CPU they share these cores (`dapo plan --calibrate` models it)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    summary["machine"] = {"cpu_cores": cores, "gpus": gpus}
    return summary


def _run_end(learner_rc: int | None, interrupted: bool, refused: Path) -> dict[str, Any]:
    return {
        "interrupted": interrupted,
        "learner_exit_code": learner_rc,
        "learner_refused_checkpoint": refused.read_text().strip() if refused.exists() else None,
    }


def _report(cfg: DapoConfig, summary: dict[str, Any], out: Path) -> None:
    accuracy = (
        f"eval accuracy {summary['base_eval_acc']:.3f} -> {summary['final_eval_acc']:.3f}"
        if cfg.eval.in_run
        else f"no evaluation in the run (eval.in_run: false; `dapo eval --run {out}`)"
    )
    sys.stderr.write(
        f"done in {summary['wall_seconds']:.0f}s: {accuracy} over {summary['steps']} steps; "
        f"ledger {summary['ledger']}\n"
        f"summary: {out / 'summary.json'}, per-step metrics: {out / 'metrics.jsonl'}, "
        f"curves: {out / 'curves.svg'}\n"
    )


def _budget_text(cfg: DapoConfig, model_config: str | None, gpu_memory_gib: float | None) -> str:
    shape_file = Path(model_config) if model_config else Path(cfg.model.path) / "config.json"
    if not shape_file.exists():
        return f"no model config at {shape_file}: pass --model-config FILE for the memory budget"
    gib = gpu_memory_gib or gpu_memory_of_this_machine() or 80.0
    return budget(cfg, ModelShape.from_file(shape_file), gib).describe(gib)


def _run_finished(bus: StreamBus, attempts: int = 3) -> bool:
    """The learner records `finished` when it completed total_steps (not when merely stopped)."""
    for attempt in range(attempts):
        try:
            return bus.run_field(RunField.FINISHED) == "1"
        except redis.RedisError as exc:
            log.warning("could not read whether the run finished (%s)", exc)
            time.sleep(1.0 + attempt)
    return False


def _set_aside_checkpoints(store: Path) -> None:
    """A fresh run must not resume an earlier run's checkpoints: move them aside, never delete."""
    if store.is_dir() and any(store.iterdir()):
        aside = store.with_name(f"{store.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        store.rename(aside)
        log.warning(
            "moved the earlier run's checkpoints to %s (use --resume to continue a run)", aside
        )


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
            kind = svc.name.split("-")[0]
            bus.drop_heartbeat(kind, instance_id(kind, pid=svc.proc.pid))
    if svc.log_file:
        svc.log_file.close()
    delay = min(2.0**svc.restarts, 30.0)
    log.warning(
        "%s exited with %s; restart %d/%d in %.0fs", svc.name, rc, svc.restarts, MAX_RESTARTS, delay
    )
    time.sleep(delay)
    svc.start(env)


def _stop_all(services: list[Service], *, learner_first: bool, grace_s: float = 30.0) -> None:
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
