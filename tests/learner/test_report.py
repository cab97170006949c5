"""The learner's per-step batch statistics (`learner.report.group_metrics`)."""

from __future__ import annotations

from contracts.schemas import PromptJob, Response, ScoredGroup
from learner.report import group_metrics


def test_response_lengths_count_the_models_tokens_not_tool_results() -> None:
    """`response_length/*` is what the model wrote (docs/algorithm.md s12): a 10-token response
    of which a tool inserted 6 has length 4; `rollout/tokens` counts every token processed."""
    job = PromptJob(
        group_id="g-0",
        prompt_index=0,
        prompt_ids=[5, 6],
        ground_truth="1",
        issued_version=0,
        issued_at=0.0,
    )
    responses = [
        Response(
            token_ids=list(range(10)),
            logprobs=[-0.1] * 10,
            finish_reason="stop",
            tool_spans=[(2, 8)],
            tool_calls=1,
        ),
        Response(token_ids=[1, 2], logprobs=[-0.1] * 2, finish_reason="length"),
    ]
    group = ScoredGroup(
        job=job,
        policy_version=0,
        replica_id="r",
        responses=responses,
        rewards=[1.0, -1.0],
        scores=[1.0, -1.0],
        acc=[True, False],
        preds=["", ""],
    )
    metrics = group_metrics([group], trained_on=0)
    assert metrics["response_length/mean"] == 3.0
    assert metrics["response_length/max"] == 4.0
    assert metrics["response_length/clip_ratio"] == 0.5
    assert metrics["rollout/tokens"] == 12.0
