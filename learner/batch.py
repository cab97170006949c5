"""Turn kept prompt groups into padded training tensors.

Layout: each row is one response, `prompt (left-padded to P) + response (right-padded to R)`.
The hidden state that scores response token t sits at position P - 1 + t (`score_rows`).

`pack_groups` re-lays a micro-batch of whole groups for the model: one row per group, its prompt
once and then each response at its own length, back to back, padding only at the row's end, with
an attention mask that lets every response see the prompt and itself only. Each response then
sees exactly the tokens and positions it sees in its own row, so log-probs and gradients are
those of the row layout, while a group's prompt is computed once instead of G times and no
position is spent on padding between responses (issue 39: with fixed-width slots about half the
reply positions of the SmolLM2 preset were padding). That holds only where the model applies the
4-D mask exactly as given: under `PACKED_ATTENTION` (sdpa), and in full-attention layers only
(`packed_layout_problem`). Either layout names its scored positions (`ScoredPositions`): the
trainer's head scores those N real tokens only, never padding. Advantages are computed here,
after dynamic sampling (docs/algorithm.md s6): the group's scalar rewards, placed on each
response's last token, sum to the response return, which is normalised within the group (s3) and
shared by every token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

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
        out: dict[str, Any] = {}
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


class ScoredPositions(NamedTuple):
    """Where a laid-out micro-batch's response tokens are scored, one entry per real token (N of
    them; padding is never scored): the hidden state that predicts the token, the token, and the
    place of its result in the micro-batch's (B, R) response layout."""

    positions: Tensor  # (N,) long: row x L + position, into the model's (rows, L) input
    labels: Tensor  # (N,) long: the response token
    targets: Tensor  # (N,) long: b x R + t, its place in the (B, R) response layout


def response_lengths(mb: TrainBatch) -> Tensor:
    """(B,) long: tokens in each response, tool tokens included (they are context)."""
    return mb.attention_mask[:, mb.prompt_len :].sum(-1)


def score_rows(mb: TrainBatch) -> ScoredPositions:
    """The row layout's scored positions: token t of row b is predicted at P - 1 + t."""
    P, R = mb.prompt_len, mb.responses.shape[1]
    b, t = (torch.arange(R) < response_lengths(mb).unsqueeze(-1)).nonzero(as_tuple=True)
    return ScoredPositions(b * (P + R) + P - 1 + t, mb.responses[b, t], b * R + t)


class PackedGroups(NamedTuple):
    """A micro-batch laid out one row per group (module docstring); L = the longest group's prompt
    plus its responses."""

    input_ids: Tensor  # (g, L) long: the prompt, each response at its own length, then padding
    position_ids: Tensor  # (g, L) long: each response continues the prompt's positions
    attention_mask: Tensor  # (g, 1, L, L) bool: True where a query position may attend to a key
    scored: ScoredPositions


def pack_groups(mb: TrainBatch) -> PackedGroups:
    """One row per group of `mb` (its rows need not be contiguous); see the module docstring."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(mb.group_index.tolist()):
        members.setdefault(group, []).append(row)
    P, R = mb.prompt_len, mb.responses.shape[1]
    prompt_lens = mb.attention_mask[:, :P].sum(-1).tolist()
    lengths = response_lengths(mb).tolist()
    L = max(prompt_lens[m[0]] + sum(lengths[r] for r in m) for m in members.values())
    g = len(members)
    input_ids = torch.zeros((g, L), dtype=torch.long)
    position_ids = torch.zeros((g, L), dtype=torch.long)
    segment = torch.full((g, L), -1, dtype=torch.long)  # 0: the prompt, s: response s, -1: padding
    positions, targets = [], []
    for k, group_rows in enumerate(members.values()):
        p = prompt_lens[group_rows[0]]
        input_ids[k, :p] = mb.input_ids[group_rows[0], P - p : P]
        position_ids[k, :p] = torch.arange(p)
        segment[k, :p] = 0
        start = p
        for s, row in enumerate(group_rows, start=1):
            n = lengths[row]
            input_ids[k, start : start + n] = mb.responses[row, :n]
            position_ids[k, start : start + n] = torch.arange(p, p + n)
            segment[k, start : start + n] = s
            # Token 0 is predicted by the prompt's last position, token t by the one before it.
            before = torch.cat([torch.tensor([p - 1]), torch.arange(start, start + n - 1)])
            positions.append(k * L + before[:n])
            targets.append(row * R + torch.arange(n))
            start += n
    pos = torch.arange(L)
    causal = pos.unsqueeze(1) >= pos.unsqueeze(0)  # (L, L): query i, key j <= i
    key = segment.unsqueeze(1)  # (g, 1, L)
    # A query sees the prompt and its own response; padding keys are never seen.
    visible = (key == 0) | (key == segment.unsqueeze(2))  # (g, L, L)
    mask = causal & visible & (key >= 0)
    mask |= torch.eye(L, dtype=torch.bool)  # a padding query attends to itself (no empty row)
    flat_positions, flat_targets = torch.cat(positions), torch.cat(targets)
    labels = mb.responses.reshape(-1)[flat_targets]
    scored = ScoredPositions(flat_positions, labels, flat_targets)
    return PackedGroups(input_ids, position_ids, mask.unsqueeze(1), scored)


PACKED_ATTENTION = "sdpa"
"""The attention implementation the trainer loads the policy with, the one under which the packed
layout gives each response exactly its own row's log-probs. Under eager attention the same mask
gives log-probs up to 0.3 away from the row layout's (tests/learner/test_trainer.py)."""


MATH_ATTENTION_MAX_LEN = 128
"""On a CPU, rows of at most this many positions run sdpa's math kernel rather than its flash
kernel (`attention_kernel`): both apply the mask as given, and at SmolLM2-135M's shape (4 rows x
9 heads x 110 positions, bf16, one thread) a layer's attention took 5.5 ms forward and backward
against 10.7 (issue 39). At 220 positions the two were even and beyond that flash is faster; the
math kernel also keeps every score for the backward."""


def attention_kernel(device: torch.device, length: int) -> contextlib.AbstractContextManager[None]:
    """The sdpa kernels a pass over rows of `length` positions may use on `device`; a backward
    that recomputes checkpointed layers must run under the same choice as their forward."""
    if device.type == "cpu" and length <= MATH_ATTENTION_MAX_LEN:
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


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
    saves (G - 1) prompts' projections and every padded position, but its attention spans the
    whole group. Per token the projections cost ~2(4h^2 + 3hi), per attended pair ~4h; packed
    rows are costed at the longest group's length, as a micro-batch pads to it."""
    groups = len(set(mb.group_index.tolist()))
    B, P, R = len(mb), mb.prompt_len, mb.responses.shape[1]
    per_token, per_pair = 2 * (4 * hidden * hidden + 3 * hidden * intermediate), 4 * hidden
    rows_cost = B * ((P + R) * per_token + (P + R) ** 2 * per_pair)
    lengths = mb.attention_mask.sum(-1)  # (B,): prompt + response of each row
    prompts = mb.attention_mask[:, :P].sum(-1)  # (B,)
    L = max(
        int(prompts[mb.group_index == k][0] + (lengths - prompts)[mb.group_index == k].sum())
        for k in sorted(set(mb.group_index.tolist()))
    )
    return groups * (L * per_token + L * L * per_pair) < rows_cost and groups * L * L <= 64 * 2**20
