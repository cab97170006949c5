"""A sample of completions (prompt, response, reward) reaches the trackers every
`tracking.log_completions_every` steps, from the groups the step trained on; TensorBoard gets it
as a markdown table in its Text tab."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from contracts.bus import open_bus
from contracts.schemas import PromptJob, Response, ScoredGroup
from learner.commands import Picked
from learner.report import CompletionSampler, RunReporter
from learner.tracking import COMPLETIONS_TAG, Completion, Trackers, markdown_table
from tests.learner.test_loop import FakeSource, config, rank0

VOCAB = {5: "What", 6: "is", 7: "2+2?", 1: "4", 2: "<|endoftext|>", 3: "5", 4: "6"}


def decode(ids: list[int]) -> str:
    return " ".join(VOCAB.get(i, f"<{i}>") for i in ids)


def group(group_id: str, prompt: list[int]) -> ScoredGroup:
    job = PromptJob(
        group_id=group_id,
        prompt_index=0,
        prompt_ids=prompt,
        ground_truth="4",
        issued_at=0.0,
        issued_version=0,
    )
    responses = [
        Response(token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="stop"),
        Response(token_ids=[3, 4], logprobs=[-0.3, -0.4], finish_reason="length"),
    ]
    return ScoredGroup(
        job=job,
        policy_version=0,
        replica_id="r0",
        responses=responses,
        scores=[1.0, -1.0],
        acc=[True, False],
        rewards=[1.0, -1.5],
        preds=["", ""],
    )


class RecordingTrackers:
    def __init__(self) -> None:
        self.logged_steps: list[int] = []
        self.completions: list[tuple[int, list[Completion]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # a training step's record (evaluation results come here too)
        if "actor/pg_loss" in metrics:
            self.logged_steps.append(step)

    def log_completions(self, step: int, completions: list[Completion]) -> None:
        self.completions.append((step, completions))

    def close(self) -> None:
        pass


def test_the_trackers_receive_completions_every_n_steps(tmp_path: Path, redis_url: str) -> None:
    cfg = config(
        tmp_path,
        "learner.total_steps=5",
        "tracking.log_completions_every=2",
        "tracking.completions_per_log=3",
    )
    batches = [[Picked(f"e{s}{g}", group(f"s{s}{g}", [5, 6, 7])) for g in "ab"] for s in range(5)]
    trackers = RecordingTrackers()
    sampler = CompletionSampler.from_config(cfg.tracking, decode)
    bus = open_bus(redis_url, "dapo", "test")
    reporter = RunReporter(trackers, sampler, transport=bus, run_state=bus, telemetry=bus)
    loop, _ = rank0(cfg, source=FakeSource(batches), reporter=reporter)
    assert loop.run() == 0
    assert trackers.logged_steps == [1, 2, 3, 4, 5]
    assert [step for step, _ in trackers.completions] == [2, 4]
    for _, sample in trackers.completions:
        # one response of each group first (groups a and b), then a second response of group a
        assert sample == [
            Completion("What is 2+2?", "4 <|endoftext|>", 1.0, True, "stop"),
            Completion("What is 2+2?", "4 <|endoftext|>", 1.0, True, "stop"),
            Completion("What is 2+2?", "5 6", -1.5, False, "length"),
        ]


def test_no_completions_when_switched_off(tmp_path: Path, redis_url: str) -> None:
    cfg = config(tmp_path, "learner.total_steps=2", "tracking.log_completions_every=0")
    trackers = RecordingTrackers()
    bus = open_bus(redis_url, "dapo", "test")
    reporter = RunReporter(
        trackers,
        CompletionSampler.from_config(cfg.tracking, decode),
        transport=bus,
        run_state=bus,
        telemetry=bus,
    )
    loop, _ = rank0(
        cfg,
        source=FakeSource([[Picked("e1", group("g1", [5]))], [Picked("e2", group("g2", [5]))]]),
        reporter=reporter,
    )
    loop.run()
    assert trackers.logged_steps == [1, 2] and trackers.completions == []


def test_sample_takes_what_there_is() -> None:
    sampler = CompletionSampler(decode, every=1, count=10)
    assert len(sampler.sample([group("g", [5])])) == 2  # one group of two responses


def test_markdown_table_shows_the_text_literally() -> None:
    table = markdown_table(
        [Completion("a | b\n*c*", "<|im_end|> x_y " + "z" * 3000, 0.5, None, "length")]
    )
    header, rule, row = table.split("\n")
    assert header == "| prompt | response | reward | acc | finish |" and rule.count("|") == 6
    assert row.startswith(r"| a \| b<br>\*c\* | &lt;\|im\_end\|&gt; x\_y zzz")
    assert row.endswith("z… | 0.500 | - | length |")
    assert len(row) < 2100  # the response was cut


def test_tensorboard_gets_the_table_as_text(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    trackers = Trackers(cfg)
    trackers.log_completions(10, [Completion("What is 2+2?", "4", 1.0, True, "stop")])
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tag = f"{COMPLETIONS_TAG}/text_summary"
    assert tag in events.Tags()["tensors"]
    [event] = events.Tensors(tag)
    text: Any = event.tensor_proto.string_val[0].decode()
    assert event.step == 10 and "| What is 2+2? | 4 | 1.000 | true | stop |" in text


@pytest.mark.parametrize("every", [0, 3])
def test_due_steps(every: int) -> None:
    sampler = CompletionSampler(decode, every=every, count=1)
    assert [s for s in range(1, 10) if sampler.due(s)] == ([] if every == 0 else [3, 6, 9])
