"""Run state: what the learner publishes about the run (policy version, learner state, run
info, evaluation history, trained group ids) and the operator's control requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from contracts.bus.hygiene import RedisHygiene
from contracts.keys import Counter, RunField
from contracts.schemas import ControlRequest, decode_control_request, parse_json
from contracts.tasks import task_label

log = logging.getLogger(__name__)


class RunState(RedisHygiene):
    """The learner's published state and the operator's requests."""

    def policy_version(self) -> int:
        """The newest policy version the learner published (0 before the first)."""
        raw: Any = self._read(None, self.redis.get, self.keys.policy_version)
        return self._int_at(self.keys.policy_version, raw, 0)

    def published_policy_version(self) -> int | None:
        """The newest policy version the learner published, or None while the key holds none
        (before the first publication, or a planted value the next one overwrites): a check
        of a message against it then lets the message pass rather than refuse good work."""
        raw: Any = self._read(None, self.redis.get, self.keys.policy_version)
        version = self._int_at(self.keys.policy_version, raw, None)
        return version if version is not None and version >= 0 else None

    def set_policy_version(self, version: int) -> None:
        self.write("SET", self.keys.policy_version, version)

    def learner_state(self) -> dict[str, str]:
        """`state`, `step`, `policy_version`, `at` as learner rank 0 last wrote them."""
        raw: Any = self._read({}, self.redis.hgetall, self.keys.learner_state)
        return _strings(raw)

    def set_learner_state(self, state: str, *, step: int, policy_version: int) -> None:
        mapping = {
            "state": state,
            "step": step,
            "policy_version": policy_version,
            "at": time.time(),
        }
        self.write("HSET", self.keys.learner_state, *(x for kv in mapping.items() for x in kv))

    def run_info(self) -> dict[str, str]:
        """The run-info hash (`RunField` names) as strings."""
        raw: Any = self._read({}, self.redis.hgetall, self.keys.run_info)
        return _strings(raw)

    def run_field(self, field: RunField) -> str | None:
        raw: Any = self._read(None, self.redis.hget, self.keys.run_info, field)
        return None if raw is None else raw.decode("utf-8", "replace")

    def run_int(self, field: RunField, default: int = 0) -> int:
        """An integer run-info field (`default` when absent or not an integer: counted)."""
        return self._int_at(
            self.keys.run_info,
            self._read(None, self.redis.hget, self.keys.run_info, field),
            default,
        )

    def update_run_info(self, fields: Mapping[RunField, str | int | float]) -> None:
        self.write("HSET", self.keys.run_info, *(x for k, v in fields.items() for x in (str(k), v)))

    def clear_run_field(self, field: RunField) -> None:
        self.write("HDEL", self.keys.run_info, str(field))

    def eval_history(self) -> list[tuple[int, float, float]]:
        """[(step, accuracy, RL seconds)] of every evaluation so far (RL seconds, -1 if unknown:
        when the evaluated weights existed, counted from the first training step); malformed history
        reads as empty."""
        try:
            rows: Any = parse_json(self.run_field(RunField.EVAL_HISTORY) or "[]", "eval history")
            return [
                (int(row[0]), float(row[1]), float(row[2]) if len(row) > 2 else -1.0)
                for row in rows
            ]
        except (ValueError, TypeError):
            log.warning("run info eval_history is malformed; treated as empty")
            return []

    def task_eval_history(self) -> list[tuple[int, dict[str, float]]]:
        """[(step, {task: accuracy})] of every evaluation round that had per-task figures;
        malformed history reads as empty."""
        try:
            text = self.run_field(RunField.TASK_EVAL_HISTORY) or "[]"
            rows: Any = parse_json(text, "task eval history")
            # Only names a task label can be (`task_label`): they reach tables and labels.
            return [
                (int(step), {t: float(acc) for t, acc in tasks.items() if task_label(t) == t})
                for step, tasks in rows
            ]
        except (ValueError, TypeError, AttributeError):
            log.warning("run info task_eval_history is malformed; treated as empty")
            return []

    def mark_trained_id(self, group_id: str) -> bool:
        """Record a trained group id; False when it was trained before."""
        return bool(self.write("SADD", self.keys.trained_ids, group_id))

    def post_control(self, request: ControlRequest) -> None:
        request.at = time.time()
        self.redis.hset(self.keys.control, request.kind, request.model_dump_json())

    def control_requests(self) -> dict[str, ControlRequest]:
        """Pending operator requests by kind. One that does not parse is removed and counted."""
        out: dict[str, ControlRequest] = {}
        requests: Any = self._read(None, self.redis.hgetall, self.keys.control)
        if requests is None:  # not a hash: no request can be read from it, nor posted to it
            self.write(
                "HDEL", self.keys.control, "-"
            )  # a no-op HDEL replaces it (write's wrong-type rule)
            return out
        for field, raw in requests.items():
            kind = field.decode("utf-8", "replace")
            try:
                request = decode_control_request(raw)
                if request.kind != kind:
                    raise ValueError(f"stored under {kind!r} but is a {request.kind!r} request")
            except (ValidationError, ValueError) as exc:
                log.error("control request %r is malformed (%s); dropped", kind, exc)
                self.redis.hdel(self.keys.control, field)
                self.incr(Counter.BAD_CONTROL_REQUESTS)
                continue
            out[kind] = request
        return out

    def clear_control(self, kind: str) -> None:
        self.write("HDEL", self.keys.control, kind)


def _strings(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}
