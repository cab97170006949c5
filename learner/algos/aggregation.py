"""Reduce a per-token loss matrix to a scalar (docs/algorithm.md section 5, Token-Level PG Loss).

With ``L`` the per-token loss [B, T] and ``M`` the response mask [B, T]:

| ``loss_agg``              | value                                                        |
|---------------------------|--------------------------------------------------------------|
| ``token-mean`` (DAPO)     | ``sum(L*M) / sum(M)``                                        |
| ``seq-mean-token-mean``   | mean over non-empty rows of ``sum_t(L*M) / sum_t(M)`` (GRPO) |
| ``seq-mean-token-sum``    | mean over non-empty rows of ``sum_t(L*M)``                   |
| ``seq-mean-token-sum-norm`` | ``sum(L*M) / norm_len`` (Dr.GRPO), ``norm_len`` = T default |

Fully masked rows never count in a denominator.

Gradient accumulation and data parallelism
------------------------------------------
The trap (docs/algorithm.md section 5): averaging per-micro-batch token means weights a token of a
short micro-batch more than a token of a long one. Here every mode is made *additive*: pass
the count of the WHOLE mini-batch (all micro-batches on all data-parallel ranks) as
``global_tokens`` (token-mean) or ``global_seqs`` (seq-mean-token-mean / -token-sum), and
the sum of the results over all micro-batches and ranks equals the full mini-batch value,
for the loss and for its gradient. ``seq-mean-token-sum-norm`` divides by a constant and is
additive without any count.

A trainer therefore:

1. sums ``count_tokens(mask)`` / ``count_seqs(mask)`` over its micro-batches, all-reduces the
   sum (SUM) across data-parallel ranks, and passes the result to every micro-batch;
2. calls ``backward()`` on each micro-batch loss without further division: accumulated
   gradients then equal the gradient of the full mini-batch loss;
3. if the data-parallel gradient all-reduce AVERAGES (DDP, FSDP and DeepSpeed defaults), it
   multiplies each micro-batch loss by ``world_size`` before ``backward()`` (the average
   divides by ``world_size``; the additive losses must be summed, not averaged). If the
   all-reduce SUMS, no scaling. The loss value to log is the SUM over micro-batches and ranks
   of the unscaled results.
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import Tensor

__all__ = [
    "LOSS_AGG_MODES",
    "LossAgg",
    "aggregate_loss",
    "count_seqs",
    "count_tokens",
]

LossAgg = Literal[
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)


def _check_mask(loss_mat: Tensor, mask: Tensor) -> None:
    if loss_mat.ndim != 2 or loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss_mat and mask must both be [B, T]; got {tuple(loss_mat.shape)} "
            f"and {tuple(mask.shape)}"
        )


def count_tokens(mask: Tensor) -> int:
    """Number of valid tokens in ``mask`` [B, T]: the local share of ``global_tokens``."""
    return int(mask.bool().sum().item())


def count_seqs(mask: Tensor) -> int:
    """Number of rows of ``mask`` [B, T] with at least one valid token: the local share of
    ``global_seqs``. Fully masked rows are not counted."""
    return int(mask.bool().any(dim=-1).sum().item())


def _denominator(local: Tensor, global_count: float | None, name: str) -> Tensor | float:
    """``global_count`` when given, else the local count; never zero (an empty batch gives a
    zero loss, not NaN)."""
    if global_count is None:
        return local.clamp(min=1)
    if global_count < 0:
        raise ValueError(f"{name} must be >= 0, got {global_count}")
    return global_count if global_count > 0 else 1.0


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    loss_agg: LossAgg,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss to a scalar with the chosen ``loss_agg`` mode.

    Args:
        loss_mat: per-token loss; [B, T].
        mask: response mask, bool or 0/1 of any dtype; [B, T].
        loss_agg: one of ``LOSS_AGG_MODES`` (see the module docstring).
        global_tokens: ``token-mean`` only. Valid-token count of the whole mini-batch across
            micro-batches and data-parallel ranks; ``None`` uses this call's own count.
        global_seqs: ``seq-mean-token-mean`` / ``seq-mean-token-sum`` only. Count of
            non-empty rows of the whole mini-batch; ``None`` uses this call's own count.
        norm_len: ``seq-mean-token-sum-norm`` only. The constant length divided by; default
            the padded length T of ``loss_mat``. Give the configured maximum response length
            so that micro-batches padded to different T share one constant.

    Arguments that do not apply to the chosen mode are ignored, so a trainer can always pass
    both counts. With the global counts given, summing the results over all micro-batches and
    ranks gives exactly the full mini-batch value; a trainer whose gradient all-reduce
    averages must multiply each result by ``world_size`` before ``backward()`` (module
    docstring).

    Returns:
        Scalar loss; 0-dim tensor, differentiable w.r.t. ``loss_mat``.

    Raises:
        ValueError: unknown ``loss_agg``, shape mismatch, a negative count, or a non-positive
            ``norm_len``.
    """
    _check_mask(loss_mat, mask)
    m = mask.to(loss_mat.dtype)  # (B, T)
    masked = loss_mat * m  # (B, T)

    if loss_agg == "token-mean":
        return masked.sum() / _denominator(m.sum(), global_tokens, "global_tokens")

    if loss_agg == "seq-mean-token-sum-norm":
        length = float(loss_mat.shape[-1]) if norm_len is None else norm_len
        if length <= 0:
            raise ValueError(f"norm_len must be > 0, got {norm_len}")
        return masked.sum() / length

    if loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        row_tokens = m.sum(dim=-1)  # (B,)
        row_loss = masked.sum(dim=-1)  # (B,)
        if loss_agg == "seq-mean-token-mean":
            # Empty rows give 0 / 1 = 0 and are excluded from the sequence count below.
            row_loss = row_loss / row_tokens.clamp(min=1)
        local_seqs = (row_tokens > 0).to(loss_mat.dtype).sum()
        return row_loss.sum() / _denominator(local_seqs, global_seqs, "global_seqs")

    raise ValueError(f"unknown loss_agg {loss_agg!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
