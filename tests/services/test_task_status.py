"""Per-task figures (issue 42) where a user reads them: /metrics carries the task as a label
(never inside a metric name), `dapo status` has a row per task, the run summary each task's
figures and first and last evaluation, and garbage in Redis is left out, not shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from contracts.bus import StreamBus, connect
from contracts.config import build_config
from contracts.keys import Keys, RunField
from contracts.tasks import TaskStats
from services.api.status import format_status, prometheus_text, run_status
from services.run.progress import summarize


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("t"), "test")
    b.ensure_groups()
    b.count_task("chain_sum", TaskStats(kept=3, filtered=1, correct=10, responses=32, tokens=64))
    b.count_task("spell_backward", TaskStats(filtered=2, responses=16, tokens=80))
    b.append_metrics(
        {
            "step": 7,
            "time": 1.0,
            "task/chain_sum/accuracy": 0.25,
            "task/chain_sum/pass_rate": 0.5,
            "task/chain_sum/response_length": 2.0,
            "rollout/acc_mean": 0.3,
        }
    )
    history = [[0, {"chain_sum": 0.1, "spell_backward": 0.0}], [7, {"chain_sum": 0.4}]]
    b.update_run_info({RunField.TASK_EVAL_HISTORY: json.dumps(history)})
    return b


def samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, task label) -> value, for the samples that carry a task label."""
    return {
        (s.name, s.labels["task"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "task" in s.labels
    }


def test_metrics_carry_the_task_as_a_label(bus: StreamBus) -> None:
    text = prometheus_text(run_status(bus, heartbeat_ttl_s=60))
    got = samples(text)
    assert got[("dapo_task_groups_kept_total", "chain_sum")] == 3
    assert got[("dapo_task_groups_filtered_total", "spell_backward")] == 2
    assert got[("dapo_task_responses_correct_total", "chain_sum")] == 10
    assert got[("dapo_task_accuracy", "chain_sum")] == 0.25  # the last step's
    assert got[("dapo_task_pass_rate", "chain_sum")] == 0.5
    assert got[("dapo_task_eval_acc", "chain_sum")] == 0.4  # the latest round
    assert ("dapo_task_eval_acc", "spell_backward") not in got  # not in the latest round
    assert "dapo_task_chain_sum" not in text  # never a task inside a name
    assert "dapo_rollout_acc_mean 0.3" in text  # the other learner metrics as before


def test_status_and_summary_have_a_row_per_task(bus: StreamBus, tmp_path: Path) -> None:
    status = run_status(bus, heartbeat_ttl_s=60)
    chain = status["tasks"]["chain_sum"]
    assert chain["accuracy"] == pytest.approx(10 / 32) and chain["pass_rate"] == 0.75
    assert (chain["base_eval_acc"], chain["eval_acc"]) == (0.1, 0.4)
    table = format_status(status)
    assert "task chain_sum" in table and "acc 0.312 pass 0.750 len 2.0 eval 0.400" in table
    assert "task spell_backward" in table and "(2 groups)" in table
    cfg = build_config({"model": {"path": "m"}, "data": {"train_path": "t"}, "output_dir": "o"})
    summary = summarize(cfg, bus, 1.0, [])
    assert summary["tasks"]["spell_backward"]["base_eval_acc"] == 0.0
    assert summary["tasks"]["spell_backward"]["eval_acc"] is None
    json.dumps(summary)  # written as summary.json


def test_garbage_task_entries_are_left_out(bus: StreamBus) -> None:
    bus.redis.hset(bus.keys.task_stats, mapping={"chain_sum:kept": "many", "a b:kept": 3})
    bad_history = [[1, {"\x1b[2Jevil": 0.5, "ok": 0.5}]]
    bus.update_run_info({RunField.TASK_EVAL_HISTORY: json.dumps(bad_history)})
    status = run_status(bus, heartbeat_ttl_s=60)
    assert set(status["tasks"]) == {"chain_sum", "spell_backward", "ok"}
    assert status["tasks"]["chain_sum"]["kept"] == 0  # the planted count is skipped
    bus.count_task("chain_sum", TaskStats(kept=2))  # and the next count starts it again
    assert bus.task_stats()["chain_sum"].kept == 2
    bus.update_run_info({RunField.TASK_EVAL_HISTORY: "{not json"})
    assert run_status(bus, heartbeat_ttl_s=60)["tasks"]["chain_sum"]["eval_acc"] is None
