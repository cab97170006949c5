"""Telemetry: counters, the per-step metrics history, the services' heartbeats and the final
stats an instance leaves behind."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import redis

from contracts.bus.hygiene import RedisHygiene
from contracts.schemas import SMALL_JSON_BYTES, parse_json
from contracts.tasks import TASK_STAT_NAMES, TaskStats, parse_task_stats, task_stat_field

log = logging.getLogger(__name__)

METRICS_MAXLEN = 100_000
"""Per-step metric records kept in Redis (a 32B run takes far fewer steps)."""


class Telemetry(RedisHygiene):
    """What the services report about themselves."""

    def counters(self) -> dict[str, int]:
        """Every counter; a value that is not an integer is skipped."""
        out = {}
        raw: Any = self._read({}, self.redis.hgetall, self.keys.counters)
        for k, v in raw.items():
            try:
                out[k.decode()] = int(v)
            except ValueError:
                log.warning("counter %r holds %r, not an integer; skipped", k, v)
        return out

    def count_task(self, task: str, stats: TaskStats) -> None:
        """Add one decided group's counts to its task's (`Keys.task_stats`; `task` a
        `contracts.tasks.task_label`). A count holding garbage starts again from this one's."""
        for name in TASK_STAT_NAMES:
            field, amount = task_stat_field(task, name), getattr(stats, name)
            if not amount:
                continue
            try:
                self.write("HINCRBY", self.keys.task_stats, field, amount)
            except redis.ResponseError as exc:
                if "not an integer" not in str(exc):
                    raise
                self.skip_bad_value(self.keys.task_stats, f"{field} is not an integer; replaced")
                self.write("HSET", self.keys.task_stats, field, amount)

    def task_stats(self) -> dict[str, TaskStats]:
        """Every task's counts so far; a field that is not an integer is skipped and counted."""
        raw: Any = self._read({}, self.redis.hgetall, self.keys.task_stats)
        counts = {}
        for key, value in raw.items():
            number = self._int_at(self.keys.task_stats, value, None)
            if number is not None:
                counts[key.decode("utf-8", "replace")] = number
        return parse_task_stats(counts)

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        self.write(
            "XADD", self.keys.metrics, "MAXLEN", "~", METRICS_MAXLEN, "*", "m", json.dumps(record)
        )

    def recent_metrics(self, count: int | None = None) -> list[dict[str, Any]]:
        """The last `count` per-step records (all when None), oldest first; a record that is not
        a JSON object with an integer `step` is skipped (not counted: readers poll this often)."""
        newest_first: Any = (
            None if count is None else self.redis.xrevrange(self.keys.metrics, count=count)
        )
        rows: Any = (
            self.redis.xrange(self.keys.metrics) if newest_first is None else newest_first[::-1]
        )
        out = []
        for _, fields in rows:
            try:
                record = parse_json(fields[b"m"], "metrics record", SMALL_JSON_BYTES)
            except (KeyError, ValueError):
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
        return out

    def last_metrics(self) -> dict[str, Any]:
        recent = self.recent_metrics(1)
        return recent[-1] if recent else {}

    def live_instances(self, role: str = "*") -> list[dict[str, Any]]:
        """Status of every instance whose heartbeat has not expired, with `age_s` added.

        A heartbeat that is not a JSON object with a string `id`, a numeric `at` and (when
        present) an integer `policy_version` is skipped and counted (`bad_redis_values`): one
        garbage value must not take down the readers (the API, the learner's weight sync)."""
        now = time.time()
        out = []
        for key in self.redis.scan_iter(match=self.keys.heartbeat_pattern(role), count=200):
            raw = self._read(None, self.redis.get, key)
            if raw is None:  # expired between the scan and the read (or not a string)
                continue
            try:
                info: Any = parse_json(raw, "heartbeat", SMALL_JSON_BYTES)
                if not isinstance(info, dict) or not isinstance(info.get("id"), str):
                    raise ValueError("not a JSON object with a string id")
                info["age_s"] = round(now - float(info.get("at", now)), 3)
                if "policy_version" in info:
                    info["policy_version"] = int(info["policy_version"])
            except (ValueError, TypeError, OverflowError) as exc:
                self.skip_bad_value(key, exc, raw)
                continue
            out.append(info)
        return sorted(out, key=lambda i: (str(i.get("role", "")), str(i.get("id", ""))))

    def drop_heartbeat(self, role: str, instance_id: str) -> None:
        """Declare an instance gone before its heartbeat expires (the supervisor saw it die)."""
        self.redis.delete(self.keys.heartbeat(role, instance_id))

    def write_final_stats(self, role: str, instance_id: str, stats: Mapping[str, Any]) -> None:
        """What the run summary reports about an instance after it is gone."""
        self.redis.hset(
            self.keys.final_stats(role, instance_id),
            mapping={k: json.dumps(v) for k, v in stats.items()},
        )

    def final_stats(self, role: str) -> dict[str, dict[str, Any]]:
        """Final stats of every instance of `role` that wrote them, by instance id."""
        out = {}
        for key in self.redis.scan_iter(match=self.keys.final_stats_pattern(role)):
            stats: Any = self._read(None, self.redis.hgetall, key)
            if not stats:  # expired since the scan, or not a hash
                continue
            try:
                out[key.decode().rsplit(":", 1)[-1]] = {
                    k.decode(): parse_json(v, "final stats", SMALL_JSON_BYTES)
                    for k, v in stats.items()
                }
            except ValueError:
                continue
        return out
