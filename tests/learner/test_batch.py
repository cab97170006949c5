"""Batch assembly: layout, group advantages and overlong filtering (docs/algorithm.md s2, s3)."""

from __future__ import annotations

import torch

from learner.batch import build_batch
from services.contracts.schemas import PromptJob, Response, RolloutGroup


def _group(finish: list[str], rewards: list[float]) -> RolloutGroup:
    job = PromptJob(group_id="g-0", prompt_index=0, prompt_ids=[5, 6], ground_truth="1", policy_version=0, issued_at=0.0)
    responses = [Response(token_ids=[1, 2, 3][: i + 1], logprobs=[-0.1] * (i + 1), finish_reason=f) for i, f in enumerate(finish)]  # type: ignore[arg-type]
    return RolloutGroup(job=job, policy_version=0, replica_id="r", responses=responses, rewards=rewards,
                        scores=rewards, acc=[r > 0 for r in rewards])


def test_overlong_filter_masks_only_truncated_responses() -> None:
    group = _group(["stop", "length", "stop"], [1.0, -1.0, -1.0])
    kept = build_batch([group], pad_id=0, overlong_filter=False)
    filtered = build_batch([group], pad_id=0, overlong_filter=True)
    assert kept.response_mask.sum(-1).tolist() == [1.0, 2.0, 3.0]
    assert filtered.response_mask.sum(-1).tolist() == [1.0, 0.0, 3.0]
    # The truncated response still counts in its group's advantages; it only carries no loss.
    torch.testing.assert_close(kept.advantages, filtered.advantages)


def test_rewards_sit_on_the_last_token_and_advantages_are_group_relative() -> None:
    batch = build_batch([_group(["stop", "stop", "stop"], [1.0, -1.0, -1.0])], pad_id=0)
    assert batch.token_rewards[0].tolist() == [1.0, 0.0, 0.0]
    assert batch.token_rewards[2].tolist() == [0.0, 0.0, -1.0]
    assert batch.advantages[0] > 0 > batch.advantages[1]
    assert abs(float(batch.advantages.sum())) < 1e-6
