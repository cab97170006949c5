"""Turn kept prompt groups into padded training tensors.

Layout: each row is one response, `prompt (left-padded to P) + response (right-padded to R)`.
The logits that score response token t sit at position P - 1 + t, so the trainer slices
`logits[:, P-1 : P-1+R]` against `responses`.

`pack_groups` re-lays a micro-batch of whole groups for the model: one row per group, its prompt
once and then each response in a slot of width R, with an attention mask that lets every slot
see the prompt and itself only. Each response then sees exactly the tokens and positions it sees
in its own row, so log-probs and gradients are those of the row layout, while a group's prompt is
computed once instead of G times. That holds only where the model applies the 4-D mask exactly
as given: under `PACKED_ATTENTION` (sdpa), and in full-attention layers only
(`packed_layout_problem`). Advantages are computed here, after dynamic
sampling (docs/algorithm.md s6): the group's scalar rewards, placed on each response's last token,
sum to the response return, which is normalised within the group (s3) and shared by every token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from contracts.schemas import ScoredGroup
from learner.algos import group_advantages


@dataclass
class TrainBatch:
    input_ids: Tensor  # (B, P + R) long
    attention_mask: Tensor  # (B, P + R) long
    position_ids: Tensor  # (B, P + R) long
    responses: Tensor  # (B, R) long: response tokens (pad where masked)
    response_mask: Tensor  # (B, R) float: 1 on tokens the model sampled (not padding, not tools)
    token_rewards: Tensor  # (B, R) float: the shaped reward on each response's last token
    advantages: Tensor  # (B,) float
    behaviour_log_prob: Tensor  # (B, R) float: log-probs recorded by the generating engine
    policy_version: Tensor  # (B,) long: version that generated each row
    group_index: Tensor  # (B,) long: which group each row belongs to (0..num_groups-1)
    prompt_len: int  # P
    model_len: int  # the most model tokens of any response (R less tool tokens): L_norm

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: Tensor | list[int]) -> TrainBatch:
        idx = torch.as_tensor(rows, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.index_select(0, idx) if isinstance(value, Tensor) else value
        return TrainBatch(**out)


def build_batch(
    groups: list[ScoredGroup],
    *,
    pad_id: int,
    norm_by_std: bool = True,
    overlong_filter: bool = False,
) -> TrainBatch:
    """Pad every response of every group into one batch and compute group advantages."""
    rows = [(gi, g, ri, r) for gi, g in enumerate(groups) for ri, r in enumerate(g.responses)]
    if not rows:
        raise ValueError("build_batch needs at least one response")
    P = max(len(g.job.prompt_ids) for g in groups)
    R = max(1, max(len(r.token_ids) for *_, r in rows))
    # seq-mean-token-sum-norm's constant (docs/algorithm.md s5): the padded width in the model's
    # tokens, as the loss counts them; tool results would otherwise lengthen it.
    model_len = max(1, max(r.model_tokens for *_, r in rows))
    B = len(rows)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    response_mask = torch.zeros((B, R))
    behaviour = torch.zeros((B, R))
    token_rewards = torch.zeros((B, R))
    for b, (_, g, ri, r) in enumerate(rows):
        p, n = g.job.prompt_ids, len(r.token_ids)
        input_ids[b, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attention_mask[b, P - len(p) : P + n] = 1
        if n:
            input_ids[b, P : P + n] = torch.tensor(r.token_ids, dtype=torch.long)
            behaviour[b, :n] = torch.tensor(r.logprobs)
            keep = not (overlong_filter and r.finish_reason == "length")
            response_mask[b, :n] = float(keep)
            for start, stop in r.tool_spans:  # a tool's result: context, not the model's tokens
                response_mask[b, start:stop] = 0.0
            token_rewards[b, n - 1] = g.rewards[ri]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    returns = token_rewards.sum(-1)  # (B,): the outcome reward sits on the last token
    group_index = torch.tensor([gi for gi, *_ in rows], dtype=torch.long)
    advantages = group_advantages(returns, group_index.tolist(), norm_by_std=norm_by_std)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=input_ids[:, P:].clone(),
        response_mask=response_mask,
        token_rewards=token_rewards,
        advantages=advantages,
        behaviour_log_prob=behaviour,
        policy_version=torch.tensor([g.policy_version for _, g, *_ in rows], dtype=torch.long),
        group_index=group_index,
        prompt_len=P,
        model_len=model_len,
    )


class PackedGroups(NamedTuple):
    """A micro-batch laid out one row per group (module docstring); L = P + S x R."""

    input_ids: (
        Tensor  # (g, L) long: the prompt (left-padded to P), then S response slots of width R
    )
    position_ids: Tensor  # (g, L) long: each slot continues the prompt's positions
    attention_mask: Tensor  # (g, 1, L, L) bool: True where a query position may attend to a key
    keep: Tensor  # (S x R,) long: the positions whose hidden states predict each slot's tokens
    rows: Tensor  # (g, S) long: the micro-batch row in each slot (-1: an empty slot)


def pack_groups(mb: TrainBatch) -> PackedGroups:
    """One row per group of `mb` (its rows need not be contiguous); see the module docstring."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(mb.group_index.tolist()):
        members.setdefault(group, []).append(row)
    groups = list(members.values())
    g, S, P, R = len(groups), max(len(m) for m in groups), mb.prompt_len, mb.responses.shape[1]
    L = P + S * R
    input_ids = torch.zeros((g, L), dtype=torch.long)
    position_ids = torch.zeros((g, L), dtype=torch.long)
    key_ok = torch.ones((g, L), dtype=torch.bool)  # prompt padding is never attended to
    rows = torch.full((g, S), -1, dtype=torch.long)
    for k, group_rows in enumerate(groups):
        first = group_rows[0]
        input_ids[k, :P] = mb.input_ids[first, :P]
        position_ids[k, :P] = mb.position_ids[first, :P]
        key_ok[k, :P] = mb.attention_mask[first, :P].bool()
        prompt_len = int(mb.attention_mask[first, :P].sum())
        for s, row in enumerate(group_rows):
            start = P + s * R
            input_ids[k, start : start + R] = mb.responses[row]
            position_ids[k, start : start + R] = torch.arange(prompt_len, prompt_len + R)
            rows[k, s] = row
    slot = torch.cat(
        [torch.full((P,), -1), torch.arange(S).repeat_interleave(R)]
    )  # (L,): -1 = prompt
    pos = torch.arange(L)
    causal = pos.unsqueeze(1) >= pos.unsqueeze(0)  # (L, L): query i, key j <= i
    visible = (slot.unsqueeze(0) == -1) | (
        slot.unsqueeze(0) == slot.unsqueeze(1)
    )  # the prompt, or the same slot
    mask = (causal & visible).unsqueeze(0) & key_ok.unsqueeze(1)  # (g, L, L)
    mask |= torch.eye(
        L, dtype=torch.bool
    )  # a padding query attends to itself (no empty softmax row)
    t = torch.arange(R).repeat(S)  # (S*R,)
    keep = torch.where(t == 0, P - 1, P + torch.arange(S).repeat_interleave(R) * R + t - 1)
    return PackedGroups(input_ids, position_ids, mask.unsqueeze(1), keep, rows)


PACKED_ATTENTION = "sdpa"
"""The attention implementation the trainer loads the policy with, the one under which the packed
layout gives each response exactly its own row's log-probs. Under eager attention the same mask
gives log-probs up to 0.3 away from the row layout's (tests/learner/test_trainer.py)."""


def packed_layout_problem(config: Any) -> str | None:
    """Why `pack_groups` would not reproduce the row layout under this model config (a Hugging Face
    `PretrainedConfig`, read for the attention it runs), or None when it does.

    The packed mask is exact only when the model applies it as given: `PACKED_ATTENTION`, and
    full attention in every layer. A sliding-window (or chunked, or linear) layer would need its
    window measured within each slot, and the 4-D mask replaces the window the model would build
    from the row's positions: such layers would see the whole prompt and slot instead.
    """
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != PACKED_ATTENTION:
        return (
            f"the model runs {implementation!r} attention; the packed mask is exact under "
            f"{PACKED_ATTENTION!r} only"
        )
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # newer configs name each layer's attention
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            return (
                f"the model has {', '.join(other)} layers (config.layer_types); the packed "
                "mask is full attention"
            )
        return None
    window = getattr(config, "sliding_window", None)
    # Mistral-style configs have no `use_sliding_window` switch: a window is always on.
    if window and getattr(config, "use_sliding_window", True):
        return f"the model uses sliding-window attention (config.sliding_window={window})"
    return None


def packing_saves_flops(mb: TrainBatch, *, hidden: int, intermediate: int) -> bool:
    """True when the packed layout costs fewer FLOPs per layer than one row per response: it
    saves (G - 1) prompts' projections but its attention spans the whole group. Per token the
    projections cost ~2(4h^2 + 3hi), per attended pair ~4h."""
    groups = int(mb.group_index.unique().numel())
    B, P, R = len(mb), mb.prompt_len, mb.responses.shape[1]
    S = -(-B // groups)
    per_token, per_pair = 2 * (4 * hidden * hidden + 3 * hidden * intermediate), 4 * hidden
    rows_cost = B * ((P + R) * per_token + (P + R) ** 2 * per_pair)
    L = P + S * R
    return groups * (L * per_token + L * L * per_pair) < rows_cost and groups * L * L <= 64 * 2**20
