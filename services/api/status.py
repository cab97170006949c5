"""Reading the run's state out of Redis: what `/status`, `/metrics` and `dapo status` show.

Everything here is derived from Redis (the learner's state hash and metrics stream, the ledger,
stream depths, heartbeats, counters and the control hash), so any number of API replicas can
serve it. What Redis holds is treated as untrusted input: a value without the expected shape (a
heartbeat that is not a JSON object, a count that is not an integer, a key of the wrong type) is
left out and counted in the status's `skipped_values` (by source) instead of failing the whole
status. An unreachable Redis still raises `redis.RedisError` (the API answers 503 for it).

Strings read from Redis (instance ids, states, the run name) are passed on as data; escaping
them is the consumer's job: the dashboard only ever sets them as text, the Prometheus page is
written by prometheus_client (which escapes label values), and the `dapo status` table escapes
control characters.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contracts.bus import LedgerSnapshot, StreamBus, open_bus
from contracts.bus.roles import Role
from contracts.keys import LEDGER_FIELDS, Counter, RunField, restarts_counter
from services.api.task_status import task_families, task_lines, task_section

log = logging.getLogger(__name__)
T = TypeVar("T")

# What reading a malformed value raises (int("x"), json of the wrong shape, a missing key). Redis
# being down raises redis.RedisError instead, which is deliberately not among them.
_MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError)
# Redis's own refusals that are about what a key holds (a key of another type; a counter the
# reader bumps, e.g. for a dropped control request, that holds no integer), not about Redis.
_MALFORMED_REPLIES = ("WRONGTYPE", "not an integer", "not a valid float")
_RESTARTS_PREFIX = restarts_counter("")


class _Skipped:
    """Counts of values left out of one status, by source (`heartbeats`, `ledger`, ...)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, source: str, n: int = 1) -> None:
        if n:
            self.counts[source] = self.counts.get(source, 0) + n

    def read(self, source: str, read: Callable[[], T], default: T) -> T:
        """`read()`, or `default` when what it reads is malformed (`_MALFORMED_REPLIES` included).
        Does NOT catch Redis being unreachable, nor refusing a write at maxmemory; and cannot tell
        a bug in a reader from a malformed value (both are logged with the exception, and
        counted)."""
        try:
            return read()
        except _MALFORMED as exc:
            reason = repr(exc)
        except redis.ResponseError as exc:
            if not any(marker in str(exc) for marker in _MALFORMED_REPLIES):
                raise
            reason = str(exc)
        log.warning("status: %s in Redis is malformed (%s); left out", source, reason)
        self.add(source)
        return default


def _intact(ledger: LedgerSnapshot) -> LedgerSnapshot:
    """A damaged ledger is shown as unknown, not as counts that are not the run's."""
    if ledger.damaged:
        raise ValueError("a count in the ledger is not an integer, or the ledger is not a hash")
    return ledger


def run_status(bus: StreamBus, *, heartbeat_ttl_s: float) -> dict[str, Any]:
    """The run's state as a JSON-able dict; sections whose Redis values are malformed read as
    empty / None and are counted in `skipped_values`."""
    keys, skipped = bus.keys, _Skipped()
    state: dict[str, str] = skipped.read("learner_state", bus.learner_state, {})
    info: dict[str, str] = skipped.read("run_info", bus.run_info, {})
    ledger = skipped.read("ledger", lambda: _intact(bus.ledger()).as_dict(), None)
    records: list[Any] = skipped.read("metrics", lambda: bus.recent_metrics(20), [])
    metrics = [m for m in records if isinstance(m, dict)]
    instances = _instances(skipped.read("heartbeats", bus.live_instances, []), skipped)
    learner_fresh = any(
        i["role"] == "learner" and i["heartbeat_age_s"] < heartbeat_ttl_s for i in instances
    )
    learner_state = state.get("state", "unknown")
    status: dict[str, Any] = {
        "run_name": info.get(RunField.RUN_NAME, keys.ns),
        "namespace": keys.ns,
        "step": _int(state.get("step")),
        "policy_version": skipped.read("policy_version", bus.policy_version, None),
        "learner_state": learner_state if learner_fresh or learner_state == "finished" else "down",
        "paused": skipped.read("control", lambda: "pause" in bus.control_requests(), None),
        "stream_depths": skipped.read("stream_depths", bus.depths, dict[str, int]()),
        "dead_letters": skipped.read("dead_letters", bus.dead_letter_count, None),
        "ledger": ledger,
        "gatekeeper_pass_rate": None
        if ledger is None
        else skipped.read("counters", lambda: bus.pass_rate(ledger["filtered"]), None),
        "throughput": _throughput(metrics),
        "base_eval_acc": _float(info.get(RunField.BASE_EVAL_ACC)),
        "redis_data_lost_at": _float(info.get(RunField.REDIS_DATA_LOST_AT)),
        "redis_memory": bus.memory_report(),
        "eval_history": _eval_history(skipped.read("eval_history", bus.eval_history, []), skipped),
        "last_metrics": metrics[-1] if metrics else {},
        "tasks": task_section(
            skipped.read("task_stats", bus.task_stats, {}),
            skipped.read("task_eval_history", bus.task_eval_history, []),
        ),
        # Read last: the reads above count the malformed values they meet.
        "counters": _counters(skipped.read("counters", bus.counters, dict[str, int]()), skipped),
        "instances": instances,
        "skipped_values": skipped.counts,
        "at": time.time(),
    }
    status["generation"] = _generation(ledger, status["counters"])
    return status


def _generation(ledger: dict[str, Any] | None, counters: dict[str, int]) -> dict[str, Any]:
    """What generation paid for what was trained: training groups generated (trained, filtered
    or gone stale) per group trained (1.0: nothing wasted), and prompts skipped before
    generation (`algorithm.prompt_skip`)."""
    skipped = counters.get(Counter.PROMPTS_SKIPPED, 0)
    if ledger is None or not ledger["trained"]:
        return {"generated_per_trained": None, "prompts_skipped": skipped}
    generated = ledger["trained"] + ledger["filtered"] + ledger["stale"]
    return {
        "generated_per_trained": round(generated / ledger["trained"], 4),
        "prompts_skipped": skipped,
    }


def _instances(raw: Iterable[Any], skipped: _Skipped) -> list[dict[str, Any]]:
    """Heartbeats as instance rows; one without a string role and id and a finite age, or a
    second one claiming the same (role, id), is skipped. A malformed optional field reads as
    None (or is left out) and is counted under `heartbeat_fields`."""
    out, seen = [], set()
    for hb in raw:
        row = _instance(hb) if isinstance(hb, dict) else None
        if row is None or (row["role"], row["id"]) in seen:
            skipped.add("heartbeats")
            continue
        seen.add((row["role"], row["id"]))
        bad = sum(
            1 for k in ("host", "pid", "policy_version") if hb.get(k) is not None and row[k] is None
        )
        for key, check in _INSTANCE_EXTRAS.items():
            if key in hb:
                value = check(hb[key])
                if value is None and hb[key] is not None:
                    bad += 1
                else:
                    row[key] = value
        skipped.add("heartbeat_fields", bad)
        out.append(row)
    return out


def _instance(hb: dict[str, Any]) -> dict[str, Any] | None:
    # `kind`: what a process of an earlier release calls its role, while a rolling upgrade has
    # both (its learner must not look down to the API meanwhile).
    role = hb.get("role", hb.get("kind"))
    inst_id, age = hb.get("id"), _finite(hb.get("age_s"))
    if not isinstance(role, str) or not isinstance(inst_id, str) or age is None:
        return None
    return {
        "role": role,
        "id": inst_id,
        "host": _text(hb.get("host")),
        "pid": _count(hb.get("pid")),
        "policy_version": _count(hb.get("policy_version")),
        "heartbeat_age_s": age,
    }


def _finite(value: Any) -> float | None:
    """A JSON number that is finite (bools are not numbers here), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: Any) -> int | None:
    """A JSON integer (bools are not), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# Optional heartbeat fields /status shows, each with the check its value must pass.
_INSTANCE_EXTRAS: dict[str, Callable[[Any], Any]] = {
    "state": _text,
    "idle_fraction": _finite,
    "groups": _count,
    "pass_rate": _finite,
}


def _eval_history(rows: Iterable[Any], skipped: _Skipped) -> list[tuple[int, float, float]]:
    """Evaluation rows with an integer step and finite accuracy and RL seconds; others counted."""
    out = []
    for row in rows:
        try:
            step, acc, rl_s = row
        except _MALFORMED:
            step = acc = rl_s = None
        if _count(step) is None or _finite(acc) is None or _finite(rl_s) is None:
            skipped.add("eval_history")
            continue
        out.append((step, acc, rl_s))
    return out


def _counters(raw: Mapping[Any, Any], skipped: _Skipped) -> dict[str, int]:
    out = {k: v for k, v in raw.items() if isinstance(k, str) and _count(v) is not None}
    skipped.add("counters", len(raw) - len(out))
    return out


def _float(value: str | None) -> float | None:
    """A finite float from a Redis string, else None."""
    try:
        return _finite(float(value)) if value is not None else None
    except ValueError:
        return None


def _int(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


def _throughput(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Prompts/s and tokens/s over the recent metric window (records without a finite `time`
    are ignored; a non-numeric count adds nothing)."""
    timed = [m for m in metrics if _finite(m.get("time")) is not None]
    span = timed[-1]["time"] - timed[0]["time"] if len(timed) >= 2 else 0.0
    if span <= 0:
        return {"prompts_per_s": 0.0, "tokens_per_s": 0.0}
    groups = sum(_finite(m.get("rollout/groups")) or 0.0 for m in timed[1:])
    tokens = sum(_finite(m.get("rollout/tokens")) or 0.0 for m in timed[1:])
    return {"prompts_per_s": groups / span, "tokens_per_s": tokens / span}


# --- Prometheus ------------------------------------------------------------------------------
_ILLEGAL_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")


class _Page(Collector):
    """The metric families of one scrape, each name once and each label set once per family.

    A family whose name (or a sample name it would expose: a counter `x` exposes `x_total`) is
    already taken is dropped, and a repeated label set within a family too: figures of the status
    itself are added before the learner's last-step metrics, so a learner metric that maps to the
    same name (`ledger/in_flight`) cannot emit a second series.
    """

    def __init__(self) -> None:
        self.families: list[Metric] = []
        self._taken: set[str] = set()

    def add(
        self,
        kind: str,
        name: str,
        help_: str,
        samples: Iterable[tuple[Mapping[str, str], float | None]],
    ) -> None:
        name = "dapo_" + _ILLEGAL_NAME_CHARS.sub("_", name)
        exposed = {name, name + "_total"} if kind == "counter" else {name}
        if exposed & self._taken:
            return
        rows: dict[tuple[tuple[str, str], ...], float] = {}
        for labels, value in samples:
            if value is not None:
                rows.setdefault(tuple(sorted(labels.items())), float(value))
        if not rows:
            return
        label_names = [k for k, _ in next(iter(rows))]
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = family_type(name, help_, labels=label_names)
        for labels_key, value in rows.items():
            family.add_metric([v for _, v in labels_key], value)
        self.families.append(family)
        self._taken |= exposed

    def gauge(self, name: str, help_: str, value: float | None) -> None:
        self.add("gauge", name, help_, [({}, value)])

    def collect(self) -> list[Metric]:
        return self.families


def prometheus_text(status: dict[str, Any]) -> str:
    """The status as Prometheus text (exposition format 0.0.4), written by prometheus_client:
    names are `dapo_` + `[a-zA-Z0-9_]`, per-service values are labels, label values escaped."""
    page = _Page()
    _run_families(page, status)
    _instance_families(page, status)
    counters = status["counters"]
    restarts = {
        k[len(_RESTARTS_PREFIX) :]: v for k, v in counters.items() if k.startswith(_RESTARTS_PREFIX)
    }
    page.add(
        "counter",
        "restarts",
        "Times the supervisor restarted a service.",
        [({"service": s}, n) for s, n in restarts.items()],
    )
    for name, value in counters.items():
        if not name.startswith(_RESTARTS_PREFIX):
            page.add("counter", name, f"Service counter {name}.", [({}, value)])
    # Per-task figures carry the task as a label, never in the name (issue 42).
    task_families(page.add, status["tasks"], status["last_metrics"])
    for key, value in status["last_metrics"].items():
        if (
            "/" in key
            and not key.startswith("task/")
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):  # NaN too: a diverged loss
            page.gauge(key, f"Last step's {key}.", value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(page)
    return generate_latest(registry).decode()


def _run_families(page: _Page, status: dict[str, Any]) -> None:
    page.gauge("step", "Training steps completed.", status["step"])
    page.gauge("policy_version", "Learner policy version.", status["policy_version"])
    page.gauge(
        "paused", "1 while training is paused by an operator request.", _flag(status["paused"])
    )
    ledger = status["ledger"] or {}
    for outcome, count in ledger.items():
        if (
            outcome in LEDGER_FIELDS
        ):  # counts of prompt jobs; not `balanced`, `damaged`, `in_flight`
            page.add("counter", f"ledger_{outcome}", f"Prompt jobs {outcome}.", [({}, count)])
    page.gauge("ledger_in_flight", "Prompt jobs in flight.", ledger.get("in_flight"))
    page.gauge(
        "ledger_balanced",
        "1 when issued + eval_issued = trained + filtered + stale + dead + evaluated + eval_dead "
        "+ in flight.",
        _flag(ledger.get("balanced")),
    )
    page.add(
        "gauge",
        "stream_depth",
        "Entries waiting or in progress per stage.",
        [({"stage": stage}, depth) for stage, depth in status["stream_depths"].items()],
    )
    mem = status["redis_memory"]
    page.gauge("redis_used_bytes", "Redis used_memory.", mem["used_bytes"])
    page.gauge("redis_peak_bytes", "Redis used_memory_peak.", mem["peak_bytes"])
    page.gauge("redis_maxmemory_bytes", "Redis maxmemory (0 = no limit).", mem["maxmemory_bytes"])
    page.gauge(
        "redis_at_maxmemory",
        "1 while Redis refuses writes (services are paused).",
        _flag(mem["at_maxmemory"]),
    )
    page.gauge(
        "dead_letter_stream_entries", "Entries in the dead-letter stream.", status["dead_letters"]
    )
    page.gauge(
        "gatekeeper_pass_rate",
        "Fraction of groups kept by dynamic sampling.",
        status["gatekeeper_pass_rate"],
    )
    page.gauge(
        "generated_per_trained",
        "Training groups generated (trained, filtered or stale) per group trained.",
        status["generation"]["generated_per_trained"],
    )
    page.gauge(
        "throughput_prompts_per_second",
        "Trained prompt groups per second.",
        status["throughput"]["prompts_per_s"],
    )
    page.gauge(
        "throughput_tokens_per_second",
        "Trained response tokens per second.",
        status["throughput"]["tokens_per_s"],
    )
    page.add(
        "gauge",
        "status_skipped_values",
        "Malformed values in Redis left out of this status, by source.",
        [({"source": source}, n) for source, n in status["skipped_values"].items()],
    )


def _instance_families(page: _Page, status: dict[str, Any]) -> None:
    ids = [({"role": i["role"], "id": i["id"]}, i) for i in status["instances"]]
    page.add(
        "gauge",
        "instance_heartbeat_age_seconds",
        "Seconds since the instance's last heartbeat.",
        [(labels, i["heartbeat_age_s"]) for labels, i in ids],
    )
    page.add(
        "gauge",
        "instance_policy_version",
        "Policy version an instance holds.",
        [(labels, i["policy_version"]) for labels, i in ids],
    )


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


def _generation_line(generation: dict[str, Any]) -> str:
    ratio = generation["generated_per_trained"]
    text = "-" if ratio is None else f"{ratio:.2f} groups"
    return f"{text}, {generation['prompts_skipped']} prompts skipped before generation"


# --- the `dapo status` table -----------------------------------------------------------------
def format_status(status: dict[str, Any]) -> str:
    """The status as a readable table (what `dapo status` prints)."""
    rows = [
        ("run", _safe(status["run_name"])),
        ("step / policy version", f"{status['step']} / {_dash(status['policy_version'])}"),
        ("learner", _safe(status["learner_state"]) + (" (paused)" if status["paused"] else "")),
        ("ledger", _ledger_line(status["ledger"])),
        ("stream depths", ", ".join(f"{k} {v}" for k, v in status["stream_depths"].items())),
        ("dead letters", _dash(status["dead_letters"])),
        ("redis memory", _memory_line(status["redis_memory"])),
        (
            "gatekeeper pass rate",
            "-"
            if status["gatekeeper_pass_rate"] is None
            else f"{status['gatekeeper_pass_rate']:.3f}",
        ),
        ("generated per trained", _generation_line(status["generation"])),
        (
            "throughput",
            f"{status['throughput']['prompts_per_s']:.2f} prompts/s, "
            f"{status['throughput']['tokens_per_s']:.0f} tokens/s",
        ),
        (
            "eval",
            ", ".join(f"step {row[0]}: {row[1]:.3f}" for row in status["eval_history"][-5:]) or "-",
        ),
    ]
    rows += task_lines(status["tasks"])
    if status["skipped_values"]:
        rows.append(
            (
                "malformed in Redis",
                ", ".join(f"{_safe(k)} {v}" for k, v in status["skipped_values"].items()),
            )
        )
    last = status["last_metrics"]
    for key in (
        "critic/rewards/mean",
        "rollout/acc_mean",
        "actor/entropy",
        "actor/clipfrac_high",
        "rollout/version_lag_mean",
    ):
        if _finite(last.get(key)) is not None:
            rows.append((key, f"{last[key]:.4f}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    lines.append(f"{'role':<11}{'id':<34}{'pid':>8}{'version':>9}{'heartbeat age':>15}")
    for i in status["instances"]:
        lines.append(
            f"{_safe(i['role']):<11}{_safe(i['id']):<34}{_dash(i['pid']):>8}"
            f"{_dash(i['policy_version']):>9}{i['heartbeat_age_s']:>14.1f}s"
        )
    return "\n".join(lines)


def _safe(text: str) -> str:
    """Control characters escaped (an id from Redis must not move the terminal's cursor)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _ledger_line(led: dict[str, Any] | None) -> str:
    if led is None:
        return "unreadable (malformed in Redis)"
    return (
        f"issued {led['issued']} + eval {led['eval_issued']} = trained {led['trained']} "
        f"+ filtered {led['filtered']} + stale {led['stale']} + dead {led['dead']} "
        f"+ evaluated {led['evaluated']} + eval dead {led['eval_dead']} "
        f"+ in flight {led['in_flight']} ({'balanced' if led['balanced'] else 'NOT balanced'})"
    )


def _memory_line(mem: dict[str, Any]) -> str:
    mib = 1 << 20
    limit = f"{mem['maxmemory_bytes'] / mib:.1f} MiB" if mem["maxmemory_bytes"] else "no limit"
    line = (
        f"{mem['used_bytes'] / mib:.1f} MiB used (peak {mem['peak_bytes'] / mib:.1f}), maxmemory "
        f"{limit}"
    )
    return line + (
        " -- AT MAXMEMORY: writes refused, services paused" if mem["at_maxmemory"] else ""
    )


def print_status(cfg: Any, *, as_json: bool = False) -> int:
    import sys

    url = cfg.redis_url_for(Role.OPERATOR)
    if not url:
        sys.stderr.write("dapo status: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)\n")
        return 2
    bus = open_bus(url, cfg.queue.namespace, "status", retries=1, pause_when_full=False)
    status = run_status(bus, heartbeat_ttl_s=cfg.queue.heartbeat_ttl_s)
    sys.stdout.write((json.dumps(status, indent=1) if as_json else format_status(status)) + "\n")
    return 0
