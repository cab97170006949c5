"""The trainer's output head: log-probs and entropy straight from the final hidden states, chunk by
chunk over the real response tokens only, so the [B, T, V] logits never exist."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor

from learner.algos import log_probs_from_hidden

LOGITS_CHUNK_BYTES = 256 << 20
"""Float32 logits computed at once by `ResponseHead` (rows x vocabulary x 4 bytes)."""


class ResponseHead:
    """The policy's output projection, replaced for the trainer's passes by the fused chunked
    log-prob and entropy (`learner.algos.log_probs_from_hidden`).

    Installed as the `lm_head` module's `forward`, so the module and its parameter names stay as
    they are (checkpoints, weight sync and export see the same model), and FSDP gathers and
    reduces the weight as for any forward. While `labels` is set, the head returns
    (log-prob, entropy) of the labels instead of logits: [B, R, 2] from the hidden states it is
    given (the model called with `logits_to_keep` = the scored positions, the same in every row),
    or, with `positions` (flat indices into the [B, T] hidden states the model passes on with
    `logits_to_keep=0`), [1, N, 2] for those positions alone, so rows whose scored positions
    differ (the packed layout) score their real tokens and no padding.

    The projection runs in the weight's dtype (bf16 under `learner.mixed_precision` bf16), the
    softmax, log-probs and entropy in fp32 (`learner/algos/entropy.py`): the PPO ratio needs more
    than bf16's 8 mantissa bits.
    """

    def __init__(self, lm_head: torch.nn.Module, temperature: float) -> None:
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError(
                "the policy's lm_head has a bias; the fused log-prob head supports bias-free "
                "heads (Qwen2, Llama)"
            )
        self.lm_head, self.temperature = lm_head, temperature
        self.labels: Tensor | None = None
        self.positions: Tensor | None = None
        vocab = int(cast(Tensor, lm_head.weight).shape[0])
        self.chunk_rows = max(1, LOGITS_CHUNK_BYTES // (4 * vocab))
        lm_head.forward = self.forward

    def forward(self, hidden: Tensor) -> Tensor:
        # Read at every call: FSDP swaps the unsharded weight in around the forward.
        weight = cast(Tensor, self.lm_head.weight)
        if self.labels is None:  # any other use of the model: plain logits
            return torch.nn.functional.linear(hidden, weight)
        labels = self.labels
        if self.positions is not None:
            flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
            hidden, labels = flat.index_select(0, self.positions).unsqueeze(0), labels.unsqueeze(0)
        logp, ent = log_probs_from_hidden(
            hidden, weight, labels, temperature=self.temperature, chunk_size=self.chunk_rows
        )
        return torch.stack((logp, ent), dim=-1)  # (B, R, 2) or (1, N, 2)

    @contextlib.contextmanager
    def scoring(self, labels: Tensor, positions: Tensor | None = None) -> Iterator[None]:
        """Score `labels` (B, R), or (N,) at the flat `positions` (N,)."""
        self.labels, self.positions = labels, positions
        try:
            yield
        finally:
            self.labels = self.positions = None
