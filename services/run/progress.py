"""What `dapo run` shows and leaves behind: the live progress line on the console (`Progress`)
and, at the end, the run's summary (`summarize`, written as `summary.json`), every per-step
record (`write_metrics_jsonl`, `metrics.jsonl`) and the closing lines on the console (`report`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import redis
from tqdm import tqdm

from contracts.bus import StreamBus
from contracts.config import DapoConfig
from contracts.keys import Counter, RunField
from services.api.task_status import task_section
from services.data.prepare import Prepared
from services.run.supervisor import Service

RATE_WINDOW_S = 120.0
"""The progress line's steps/s is measured over the steps of about the last two minutes."""


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


def write_outputs(
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


def run_end(learner_rc: int | None, interrupted: bool, refused: Path) -> dict[str, Any]:
    return {
        "interrupted": interrupted,
        "learner_exit_code": learner_rc,
        "learner_refused_checkpoint": refused.read_text().strip() if refused.exists() else None,
    }


def report(cfg: DapoConfig, summary: dict[str, Any], out: Path) -> None:
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
