"""Reading the run's state out of Redis: what `/status`, `/metrics` and `dapo status` show.

Everything here is derived from Redis (the learner's state hash and metrics stream, the ledger,
stream depths, heartbeats and counters), so any number of API replicas can serve it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.contracts.bus import StreamBus, open_bus
from services.contracts.keys import RunField


def run_status(bus: StreamBus, *, heartbeat_ttl_s: float) -> dict[str, Any]:
    keys = bus.keys
    state = bus.learner_state()
    info = bus.run_info()
    counters = bus.counters()
    ledger = bus.ledger()
    metrics = bus.recent_metrics(20)
    last = metrics[-1] if metrics else {}
    throughput = _throughput(metrics)
    instances = bus.live_instances()
    learner_fresh = any(i.get("kind") == "learner" and i["age_s"] < heartbeat_ttl_s for i in instances)
    return {
        "run_name": info.get(RunField.RUN_NAME, keys.ns),
        "namespace": keys.ns,
        "step": _int(state.get("step")),
        "policy_version": bus.policy_version(),
        "learner_state": state.get("state", "unknown") if learner_fresh or state.get("state") == "finished" else "down",
        "stream_depths": bus.depths(),
        "dead_letters": bus.dead_letter_count(),
        "ledger": ledger.as_dict(),
        "gatekeeper_pass_rate": bus.pass_rate(ledger.filtered),
        "throughput": throughput,
        "base_eval_acc": _float(info.get(RunField.BASE_EVAL_ACC)),
        "redis_data_lost_at": _float(info.get(RunField.REDIS_DATA_LOST_AT)),
        "redis_memory": bus.memory_report(),
        "eval_history": bus.eval_history(),
        "last_metrics": last,
        "counters": counters,
        "instances": [
            {
                "kind": i.get("kind"), "id": i.get("id"), "host": i.get("host"), "pid": i.get("pid"),
                "policy_version": i.get("policy_version"), "heartbeat_age_s": i["age_s"],
                **{k: i[k] for k in ("state", "idle_fraction", "groups", "pass_rate") if k in i},
            }
            for i in instances
        ],
        "at": time.time(),
    }


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _int(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


def _throughput(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Prompts/s and tokens/s over the recent metric window."""
    if len(metrics) < 2:
        return {"prompts_per_s": 0.0, "tokens_per_s": 0.0}
    span = metrics[-1]["time"] - metrics[0]["time"]
    if span <= 0:
        return {"prompts_per_s": 0.0, "tokens_per_s": 0.0}
    groups = sum(m.get("rollout/groups", 0.0) for m in metrics[1:])
    tokens = sum(m.get("rollout/tokens", 0.0) for m in metrics[1:])
    return {"prompts_per_s": groups / span, "tokens_per_s": tokens / span}


def prometheus_text(status: dict[str, Any]) -> str:
    """The status as Prometheus exposition text (counters and gauges, `dapo_` prefix)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float | None, labels: str = "") -> None:
        if value is None:
            return
        if not any(line.startswith(f"# TYPE dapo_{name} ") for line in lines):
            lines.append(f"# HELP dapo_{name} {help_}")
            lines.append(f"# TYPE dapo_{name} {kind}")
        lines.append(f"dapo_{name}{labels} {float(value)}")

    metric("step", "gauge", "Training steps completed.", status["step"])
    metric("policy_version", "gauge", "Learner policy version.", status["policy_version"])
    for outcome, count in status["ledger"].items():
        if outcome != "balanced":
            kind = "gauge" if outcome == "in_flight" else "counter"
            metric(f"ledger_{outcome}" + ("" if kind == "gauge" else "_total"), kind, f"Prompt jobs {outcome}.", count)
    metric("ledger_balanced", "gauge", "1 when issued + eval_issued = trained + filtered + stale + dead + evaluated + eval_dead + in flight.",
           float(status["ledger"]["balanced"]))
    for stage, depth in status["stream_depths"].items():
        metric("stream_depth", "gauge", "Entries waiting or in progress per stage.", depth, f'{{stage="{stage}"}}')
    mem = status["redis_memory"]
    metric("redis_used_bytes", "gauge", "Redis used_memory.", mem["used_bytes"])
    metric("redis_peak_bytes", "gauge", "Redis used_memory_peak.", mem["peak_bytes"])
    metric("redis_maxmemory_bytes", "gauge", "Redis maxmemory (0 = no limit).", mem["maxmemory_bytes"])
    metric("redis_at_maxmemory", "gauge", "1 while Redis refuses writes (services are paused).", float(mem["at_maxmemory"]))
    metric("dead_letters", "gauge", "Entries in the dead-letter stream.", status["dead_letters"])
    metric("gatekeeper_pass_rate", "gauge", "Fraction of groups kept by dynamic sampling.", status["gatekeeper_pass_rate"])
    metric("throughput_prompts_per_second", "gauge", "Trained prompt groups per second.", status["throughput"]["prompts_per_s"])
    metric("throughput_tokens_per_second", "gauge", "Trained response tokens per second.", status["throughput"]["tokens_per_s"])
    for name, value in status["counters"].items():
        metric(f"{name}_total", "counter", f"Service counter {name}.", value)
    for key, value in status["last_metrics"].items():
        if isinstance(value, int | float) and "/" in key:
            metric(key.replace("/", "_"), "gauge", f"Last step's {key}.", value)
    for inst in status["instances"]:
        labels = f'{{kind="{inst["kind"]}",id="{inst["id"]}"}}'
        metric("instance_heartbeat_age_seconds", "gauge", "Seconds since the instance's last heartbeat.", inst["heartbeat_age_s"], labels)
        if inst.get("policy_version") is not None:
            metric("instance_policy_version", "gauge", "Policy version an instance holds.", inst["policy_version"], labels)
    return "\n".join(lines) + "\n"


def format_status(status: dict[str, Any]) -> str:
    """The status as a readable table (what `dapo status` prints)."""
    led = status["ledger"]
    rows = [
        ("run", status["run_name"]),
        ("step / policy version", f"{status['step']} / {status['policy_version']}"),
        ("learner", status["learner_state"]),
        ("ledger", f"issued {led['issued']} + eval {led['eval_issued']} = trained {led['trained']} + filtered {led['filtered']} "
                   f"+ stale {led['stale']} + dead {led['dead']} + evaluated {led['evaluated']} + eval dead {led['eval_dead']} "
                   f"+ in flight {led['in_flight']} ({'balanced' if led['balanced'] else 'NOT balanced'})"),
        ("stream depths", ", ".join(f"{k} {v}" for k, v in status["stream_depths"].items())),
        ("dead letters", str(status["dead_letters"])),
        ("redis memory", _memory_line(status["redis_memory"])),
        ("gatekeeper pass rate", "-" if status["gatekeeper_pass_rate"] is None else f"{status['gatekeeper_pass_rate']:.3f}"),
        ("throughput", f"{status['throughput']['prompts_per_s']:.2f} prompts/s, {status['throughput']['tokens_per_s']:.0f} tokens/s"),
        ("eval", ", ".join(f"step {row[0]}: {row[1]:.3f}" for row in status["eval_history"][-5:]) or "-"),
    ]
    last = status["last_metrics"]
    for key in ("critic/rewards/mean", "rollout/acc_mean", "actor/entropy", "actor/clipfrac_high", "rollout/version_lag_mean"):
        if key in last:
            rows.append((key, f"{last[key]:.4f}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    lines.append(f"{'kind':<11}{'id':<34}{'pid':>8}{'version':>9}{'heartbeat age':>15}")
    for i in status["instances"]:
        version = "-" if i.get("policy_version") is None else str(i["policy_version"])
        lines.append(f"{i['kind']:<11}{i['id']:<34}{i['pid']:>8}{version:>9}{i['heartbeat_age_s']:>14.1f}s")
    return "\n".join(lines)


def _memory_line(mem: dict[str, Any]) -> str:
    mib = 1 << 20
    limit = f"{mem['maxmemory_bytes'] / mib:.1f} MiB" if mem["maxmemory_bytes"] else "no limit"
    line = f"{mem['used_bytes'] / mib:.1f} MiB used (peak {mem['peak_bytes'] / mib:.1f}), maxmemory {limit}"
    return line + (" -- AT MAXMEMORY: writes refused, services paused" if mem["at_maxmemory"] else "")


def print_status(cfg: Any, *, as_json: bool = False) -> int:
    import sys

    url = cfg.redis_url
    if not url:
        sys.stderr.write("dapo status: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)\n")
        return 2
    bus = open_bus(url, cfg.queue.namespace, "status", retries=1, pause_when_full=False)
    status = run_status(bus, heartbeat_ttl_s=cfg.queue.heartbeat_ttl_s)
    sys.stdout.write((json.dumps(status, indent=1) if as_json else format_status(status)) + "\n")
    return 0
