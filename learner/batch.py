"""Turn kept prompt groups into padded training tensors.

Layout: each row is one response, `prompt (left-padded to P) + response (right-padded to R)`.
The logits that score response token t sit at position P - 1 + t, so the trainer slices
`logits[:, P-1 : P-1+R]` against `responses`. Advantages are computed here, after dynamic
sampling (docs/algorithm.md s6): the group's scalar rewards, placed on each response's last token, sum to
the response return, which is normalised within the group (s3) and shared by every token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from learner.algos import group_advantages
from services.contracts.schemas import RolloutGroup


@dataclass
class TrainBatch:
    input_ids: Tensor  # (B, P + R) long
    attention_mask: Tensor  # (B, P + R) long
    position_ids: Tensor  # (B, P + R) long
    responses: Tensor  # (B, R) long: response tokens (pad where masked)
    response_mask: Tensor  # (B, R) float: 1 on valid response tokens
    token_rewards: Tensor  # (B, R) float: the shaped reward on each response's last token
    advantages: Tensor  # (B,) float
    behaviour_log_prob: Tensor  # (B, R) float: log-probs recorded by the generating engine
    policy_version: Tensor  # (B,) long: version that generated each row
    group_index: Tensor  # (B,) long: which group each row belongs to (0..num_groups-1)
    prompt_len: int  # P

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
    groups: list[RolloutGroup], *, pad_id: int, norm_by_std: bool = True, overlong_filter: bool = False
) -> TrainBatch:
    """Pad every response of every group into one batch and compute group advantages."""
    rows = [(gi, g, ri, r) for gi, g in enumerate(groups) for ri, r in enumerate(g.responses)]
    if not rows:
        raise ValueError("build_batch needs at least one response")
    P = max(len(g.job.prompt_ids) for g in groups)
    R = max(1, max(len(r.token_ids) for *_, r in rows))
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
            assert g.rewards is not None, f"group {g.job.group_id} is unscored"
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
    )
