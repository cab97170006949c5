"""An evaluation round measures one policy: a replica generates an evaluation job without taking
in-flight weight updates, so all its responses carry the version it held at the start (even one
newer than the job's), while training jobs keep taking updates mid-generation; the result and
the round report the versions they measured, and a round whose problems came from different
versions says so."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from contracts.bus import StreamBus, connect
from contracts.config import load_config
from contracts.keys import Keys
from contracts.runtime import StopFlag
from contracts.schemas import (
    EvalResult,
    EvalTag,
    PromptJob,
    RolloutGroup,
    decode_group,
    encode_job,
)
from learner.evaluation import _Round
from rollout.hf_engine import HFEngine
from rollout.service import RolloutReplica
from tests.helpers import judged

REPO = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8]


class UpdateMidGeneration:
    """Stands in for the replica's `WeightReceiver`: holds `version`, and when the engine asks
    between decode steps, swaps in `new` weights after the 2nd sampled token (version + 1)."""

    def __init__(self, engine: HFEngine, version: int) -> None:
        self.engine, self.policy_version, self.sync_s, self.calls = engine, version, 0.0, 0
        self.new = {n: p.detach() * 1.5 for n, p in engine.model.named_parameters()}
        self.announced = threading.Event()
        self.background = True  # the transformers engine receives in the background

    def wait_for(self, version: int) -> bool:
        return self.policy_version >= version

    def between_steps(self) -> int:
        self.calls += 1
        if self.calls == 3:  # the first call comes before token 0
            self.engine.update_weights(self.new.items())
            self.policy_version += 1
        return self.policy_version


def _job(group_id: str, tag: EvalTag | None) -> PromptJob:
    return PromptJob(
        group_id=group_id,
        prompt_index=0,
        prompt_ids=PROMPT,
        ground_truth="1",
        issued_version=2,
        issued_at=time.time(),
        eval=tag,
    )


@pytest.mark.parametrize(("evaluation", "background"), [(False, True), (True, True), (True, False)])
def test_an_evaluation_job_takes_no_update_announced_mid_generation(
    redis_url: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    evaluation: bool,
    background: bool,
) -> None:
    """Held for an engine that receives in the background; an engine that receives only between
    decode steps (vLLM's) takes the update, or the learner's broadcast would wait for the batch,
    and its result reports the spread."""
    overrides = [f"output_dir={tmp_path}", "rollout.group_size=6"]
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    bus = StreamBus(connect(redis_url), Keys("eval-versions"), consumer="test")
    bus.ensure_groups()
    bus.set_policy_version(4)  # the learner published the update the replica takes mid-way
    engine = HFEngine(str(tiny_model_dir), seed=0)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    worker = RolloutReplica(
        cfg,
        engine,
        "replica",
        StopFlag(),
        transport=bus.as_consumer("replica"),
        run_state=bus.as_consumer("replica"),
    )
    worker.weights = UpdateMidGeneration(engine, version=3)  # type: ignore[assignment]
    worker.weights.background = background
    tag: EvalTag | None = None
    if evaluation:
        tag = EvalTag(round_step=2, policy_version=2, problem=0, problems=1, samples=6)
    bus.issue([encode_job(_job("g0", tag))], evaluation=evaluation)

    worker.handle(worker.transport.read(bus.keys.prompts, count=10, block_ms=None))

    [(_, fields)] = bus.redis.xrange(bus.keys.rollouts.stream)
    group = decode_group(fields)
    versions = {r.versions for r in group.responses}
    assert any(len(r.token_ids) > 2 for r in group.responses)  # long enough to span the update
    if not evaluation or not background:  # the update is taken mid-generation
        assert (3, 4) in versions and group.policy_version == 3
        if evaluation:
            result = EvalResult.of(judged(group))
            assert (result.policy_version_min, result.policy_version_max) == (3, 4)
        return
    # Every token from the weights held at the start: version 3, newer than the job's 2.
    assert versions == {(3, 3)} and group.policy_version == 3
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, before[name])  # the update waits for the batch to end
    result = EvalResult.of(judged(group))
    assert (result.policy_version_min, result.policy_version_max) == (3, 3)


def test_a_round_from_several_versions_reports_the_spread() -> None:
    tag = EvalTag(round_step=4, policy_version=4, problem=0, problems=3, samples=2)
    group = RolloutGroup.model_validate(
        {
            "job": _job("e0", tag).model_dump(),
            "policy_version": 5,
            "replica_id": "r",
            "responses": [
                {"token_ids": [1], "logprobs": [-1.0], "finish_reason": "stop", "versions": (5, 5)},
                {
                    "token_ids": [1, 2],
                    "logprobs": [-1.0, -1.0],
                    "finish_reason": "stop",
                    "versions": (5, 7),
                },
            ],
        }
    )
    # A result from an engine that took an update mid-generation:
    mixed = EvalResult.of(judged(group, [True, False]))
    assert (mixed.policy_version_min, mixed.policy_version_max, mixed.policy_version) == (5, 7, 7)

    rnd = _Round(tag)
    for problem, (low, high) in enumerate([(4, 4), (6, 6), (5, 7)]):
        rnd.results[problem] = EvalResult(
            job=_job(f"e{problem}", tag.model_copy(update={"problem": problem})),
            policy_version_min=low,
            policy_version_max=high,
            correct=1,
            samples=2,
            response_tokens=3,
            truncated=0,
        )
    metrics = rnd.metrics(issued_at=None)
    assert (metrics["eval/policy_version_min"], metrics["eval/policy_version_max"]) == (4, 7)
    assert metrics["eval/policy_version_lag"] == 3  # the newest measured minus the round's own
