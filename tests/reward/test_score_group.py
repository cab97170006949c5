"""``score_group``, the reward worker's scoring of one group (docs/algorithm.md s1 and s2)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from contracts.config import DapoConfig, load_config
from contracts.schemas import PromptJob, Response, RolloutGroup
from reward.service import score_group
from reward.text import GROUND_TRUTH_MAX_CHARS, model_token_ids
from reward.verifiers import make_scorer

REPO = Path(__file__).resolve().parents[2]


class CharTokenizer:
    """Token id = code point, so a test writes responses as text."""

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return ["".join(map(chr, row)) for row in ids]


def group_of(ground_truth: str, texts: list[str]) -> RolloutGroup:
    job = PromptJob(
        group_id="g-1",
        prompt_index=0,
        prompt_ids=[1, 2],
        ground_truth=ground_truth,
        issued_version=0,
        issued_at=0.0,
    )
    responses = [
        Response(
            token_ids=[ord(c) for c in text], logprobs=[-1.0] * len(text), finish_reason="stop"
        )
        for text in texts
    ]
    return RolloutGroup(job=job, policy_version=0, replica_id="r0", responses=responses)


@pytest.fixture(scope="module")
def cfg() -> DapoConfig:
    return load_config(REPO / "configs" / "tiny.yaml")


def test_a_group_is_scored(cfg: DapoConfig, caplog: pytest.LogCaptureFixture) -> None:
    group = group_of("42", ["Answer: 42", "no answer"])
    with caplog.at_level(logging.WARNING, logger="reward.service"):
        scored, _ = score_group(group, CharTokenizer(), make_scorer("dapo"), cfg)
    assert (scored.preds, scored.scores, scored.acc) == (
        ["42", "[INVALID]"],
        [1.0, -1.0],
        [True, False],
    )
    assert "not verified" not in caplog.text


def test_an_over_long_ground_truth_is_an_error_logged_with_its_reason(
    cfg: DapoConfig, caplog: pytest.LogCaptureFixture
) -> None:
    group = group_of("4" * (GROUND_TRUTH_MAX_CHARS + 1), ["Answer: 42", "no answer"])
    with caplog.at_level(logging.WARNING, logger="reward.service"):
        scored, _ = score_group(group, CharTokenizer(), make_scorer("dapo"), cfg)
    assert (scored.preds, scored.scores, scored.acc) == (["[ERROR]"] * 2, [-1.0] * 2, [False] * 2)
    assert (
        "group g-1: 2 responses not verified: ground truth is 1025 characters long, "
        "over GROUND_TRUTH_MAX_CHARS=1024"
    ) in caplog.text


def tool_group(ground_truth: str, turns: list[tuple[str, str]]) -> RolloutGroup:
    """One response of (model text, tool result) turns; a result is a tool span."""
    group = group_of(ground_truth, [""])
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for said, result in turns:
        ids += map(ord, said)
        if result:
            spans.append((len(ids), len(ids) + len(result)))
            ids += map(ord, result)
    group.responses[0] = Response(
        token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", tool_spans=spans
    )
    return group


# A tool's printed line ends with a newline, so the result's closing tag is not part of it.
RESULT = "<result>Answer: 42\n</result>"


def test_an_answer_only_a_tool_printed_is_not_the_models(cfg: DapoConfig) -> None:
    turns = [("Let me look it up. <lookup>the answer key</lookup>", RESULT)]
    scored, _ = score_group(tool_group("42", turns), CharTokenizer(), make_scorer("dapo"), cfg)
    assert (scored.preds, scored.acc) == (["[INVALID]"], [False])
    assert "<result>" not in scored.responses[0].text  # what was graded
    # The model's own answer after the result is graded as usual.
    turns.append(("\nAnswer: 42", ""))
    scored, _ = score_group(tool_group("42", turns), CharTokenizer(), make_scorer("dapo"), cfg)
    assert (scored.preds, scored.acc) == (["42"], [True])


def test_grade_tool_results_grades_the_full_text(cfg: DapoConfig) -> None:
    full = cfg.model_copy(
        update={"reward": cfg.reward.model_copy(update={"grade_tool_results": True})}
    )
    turns = [("Let me look it up. <lookup>the answer key</lookup>", RESULT)]
    scored, _ = score_group(tool_group("42", turns), CharTokenizer(), make_scorer("dapo"), full)
    assert (scored.preds, scored.acc) == (["42"], [True])


def test_model_token_ids_drops_every_tool_span() -> None:
    ids = list(range(10))
    assert model_token_ids(ids, []) == ids
    assert model_token_ids(ids, [(0, 2), (4, 5), (8, 10)]) == [2, 3, 5, 6, 7]
