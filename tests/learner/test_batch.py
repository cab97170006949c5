"""Batch assembly: layout, group advantages and overlong filtering (docs/algorithm.md s2, s3)."""

from __future__ import annotations

import torch

from contracts.schemas import PromptJob, Response, ScoredGroup
from learner.batch import build_batch


def _group(finish: list[str], rewards: list[float]) -> ScoredGroup:
    job = PromptJob(
        group_id="g-0",
        prompt_index=0,
        prompt_ids=[5, 6],
        ground_truth="1",
        issued_version=0,
        issued_at=0.0,
    )
    responses = [
        Response(token_ids=[1, 2, 3][: i + 1], logprobs=[-0.1] * (i + 1), finish_reason=f)
        for i, f in enumerate(finish)
    ]  # type: ignore[arg-type]
    return ScoredGroup(
        job=job,
        policy_version=0,
        replica_id="r",
        responses=responses,
        rewards=rewards,
        scores=rewards,
        acc=[r > 0 for r in rewards],
        preds=[""] * len(rewards),
    )


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


def test_packed_groups_give_every_response_exactly_what_its_own_row_gives() -> None:
    """One row per group (prompt once, responses back to back at their own lengths) vs one row
    per response: the same log-probs, to float tolerance, on a real Qwen2 model with unequal
    prompt and response lengths; and the packed rows hold no padding but at their ends."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.batch import pack_groups, score_rows

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).eval()

    def group(gid: int, prompt: list[int], lengths: list[int]) -> ScoredGroup:
        job = PromptJob(
            group_id=f"g-{gid}",
            prompt_index=gid,
            prompt_ids=prompt,
            ground_truth="1",
            issued_version=0,
            issued_at=0.0,
        )
        responses = [
            Response(
                token_ids=[(7 * i + n) % 50 for n in range(k)],
                logprobs=[-0.1] * k,
                finish_reason="stop",
            )
            for i, k in enumerate(lengths)
        ]
        return ScoredGroup(
            job=job,
            policy_version=0,
            replica_id="r",
            responses=responses,
            rewards=[1.0, -1.0, 1.0][: len(lengths)],
            scores=[1.0] * len(lengths),
            acc=[True] * len(lengths),
            preds=[""] * len(lengths),
        )

    batch = build_batch(
        [group(0, [3, 4, 5, 6, 7], [2, 5, 1]), group(1, [9, 8], [4, 3, 6])], pad_id=0
    )
    B, R = batch.responses.shape

    def scored_log_probs(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        flat = torch.log_softmax(logits.reshape(-1, logits.shape[-1])[positions.positions], -1)
        picked = flat.gather(-1, positions.labels.unsqueeze(-1)).squeeze(-1)  # (N,)
        return torch.zeros(B * R).index_copy(0, positions.targets, picked).view(B, R)

    order = [4, 0, 1, 2, 3, 5]  # rows need not be in group order
    with torch.no_grad():
        rows = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits
        expected = scored_log_probs(rows, score_rows(batch))
        packed = pack_groups(batch.select(order))
        logits = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
        ).logits
        got = scored_log_probs(logits, packed.scored)
    # The longer group fills its row: 5 prompt + 8 response tokens, 2 + 13 for the other.
    assert packed.input_ids.shape == (2, 15)
    assert packed.scored.positions.numel() == int(batch.response_mask.sum()) == 21
    mask = batch.response_mask.bool()[order]
    torch.testing.assert_close(got[mask], expected[order][mask], rtol=1e-5, atol=1e-5)
    assert float(expected[order][mask].abs().min()) > 0  # every real token was scored


def test_the_packed_layout_is_refused_for_attention_that_does_not_apply_its_mask_as_given() -> None:
    """Eager attention (packed log-probs up to 0.3 off the rows', test_trainer.py) and any layer
    that is not full attention (the 4-D mask would drop its window) are named; sdpa full
    attention is fine."""
    from transformers import MistralConfig, Qwen2Config

    from learner.batch import PACKED_ATTENTION, packed_layout_problem

    def qwen2(implementation: str, **extra: object) -> Qwen2Config:
        config = Qwen2Config(num_hidden_layers=2, **extra)
        config._attn_implementation = implementation
        return config

    assert packed_layout_problem(qwen2(PACKED_ATTENTION)) is None
    assert "'eager'" in str(packed_layout_problem(qwen2("eager")))
    sliding = qwen2(
        PACKED_ATTENTION, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    assert "sliding_attention layers" in str(packed_layout_problem(sliding))
    mistral = MistralConfig(num_hidden_layers=2, sliding_window=8)  # no layer_types, no switch
    mistral._attn_implementation = PACKED_ATTENTION
    assert "sliding_window=8" in str(packed_layout_problem(mistral))
    mistral.sliding_window = None
    assert packed_layout_problem(mistral) is None


def test_tool_tokens_carry_no_loss_and_do_not_count_in_the_norm_length() -> None:
    """A tool's result (tokens 2-5 of an 8-token response) is context: mask 0; and L_norm
    (`model_len`) is the longest response in the model's tokens, 4, not the padded width, 8."""
    group = _group(["stop", "stop", "stop"], [1.0, -1.0, -1.0])
    group.responses[1] = Response(
        token_ids=[1, 2, 9, 9, 9, 9, 3, 4],
        logprobs=[-0.1, -0.1, 0.0, 0.0, 0.0, 0.0, -0.1, -0.1],
        finish_reason="stop",
        tool_spans=[(2, 6)],
    )
    batch = build_batch([group], pad_id=0)
    assert batch.responses.shape[1] == 8
    assert batch.response_mask[1].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert batch.model_len == 4
    assert build_batch([_group(["stop", "stop"], [1.0, -1.0])], pad_id=0).model_len == 2
