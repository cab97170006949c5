"""DAPO policy loss and the combination of loss terms.

- ``policy_loss``: decoupled clip (Clip-Higher) + dual clip, docs/algorithm.md section 4, with the
  optional truncated importance weight for asynchronous (off-policy) rollouts, section 9.
- ``combine_losses``: ``pg - entropy_coef * entropy``; DAPO uses no entropy bonus and, unlike
  PPO-style RLHF, no KL penalty against a reference policy (so there is no KL term at all).

A trainer computes::

    pg, metrics = policy_loss(logp, old_logp, adv, mask, loss_agg=..., global_tokens=...)
    ent = aggregate_loss(entropy_from_logits(logits), mask, loss_agg, global_tokens=...)
    loss = combine_losses(pg, ent, entropy_coef=...)

using the same ``loss_agg`` and global counts for every term, so the combination stays
additive across micro-batches and ranks (see ``aggregation``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import LossAgg, aggregate_loss

__all__ = ["BEHAVIOUR_METRICS", "DEFAULT_IS_CLIP", "combine_losses", "policy_loss"]

# exp() of a log-ratio beyond +-20 overflows float16 and means the sample is garbage anyway.
_LOG_RATIO_BOUND = 20.0
# Default truncation of pi_old / pi_behaviour when behaviour log-probs are given (section 9).
DEFAULT_IS_CLIP = 2.0
# Metrics of the importance weight, means over the corrected (off-policy) tokens only: on-policy
# tokens have w = 1 exactly and would pull the mean towards 1 in proportion to their share.
BEHAVIOUR_METRICS = ("is_weight_mean", "is_clipfrac")


def _check_policy_args(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_log_prob: Tensor | None,
    behaviour_mask: Tensor | None,
) -> None:
    shape = log_prob.shape
    if log_prob.ndim != 2:
        raise ValueError(f"log_prob must be [B, T], got {tuple(shape)}")
    others = {"old_log_prob": old_log_prob, "response_mask": response_mask}
    if behaviour_log_prob is not None:
        others["behaviour_log_prob"] = behaviour_log_prob
    for name, t in others.items():
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(advantages.shape)}"
        )
    if behaviour_mask is not None and behaviour_mask.shape not in (shape, (shape[0], 1)):
        raise ValueError(
            f"behaviour_mask must be [B, 1] or [B, T] = {tuple(shape)}, got "
            f"{tuple(behaviour_mask.shape)}"
        )


def _check_clip_args(
    clip_low: float, clip_high: float, clip_c: float | None, is_clip: float | None
) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c (dual clip) must be > 1, got {clip_c}; use None to disable")
    if is_clip is not None and is_clip <= 0.0:
        raise ValueError(f"is_clip must be > 0, got {is_clip}")


def _masked_means(values: dict[str, Tensor], mask: Tensor) -> dict[str, float]:
    """Mean of each [B, T] tensor over valid tokens, with a single device sync."""
    n = mask.sum().clamp(min=1)
    stacked = torch.stack([(v.to(mask.dtype) * mask).sum() / n for v in values.values()])
    return dict(zip(values, stacked.tolist(), strict=True))


def policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
    loss_agg: LossAgg = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
    behaviour_log_prob: Tensor | None = None,
    behaviour_mask: Tensor | None = None,
    is_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """DAPO clipped policy-gradient loss (docs/algorithm.md sections 4, 5 and 9).

    Per token, with ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``::

        L1 = -A * ratio
        L2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)
        L  = max(L1, L2)
        L  = min(L, -A * clip_c)          only where A < 0, only if clip_c is given
        L  = w * L                        only if behaviour_log_prob is given

    where ``w = min(exp(old_log_prob - behaviour_log_prob), is_clip)`` (detached; 1 outside
    ``behaviour_mask``) is the truncated importance weight of decoupled PPO: ``old_log_prob`` is
    the learner's proximal policy (recomputed when the batch arrives), ``behaviour_log_prob`` the
    policy that generated the tokens. ``is_clip`` defaults to 2.0 when behaviour log-probs are given
    and is ignored without them. The truncation bounds the variance; it does NOT make a very
    stale batch unbiased, which is why staleness is also bounded by admission control.

    Args:
        log_prob: log-probs of the sampled tokens under the policy being trained; [B, T].
        old_log_prob: log-probs under the policy at the start of the step; [B, T]
            (treated as a constant).
        advantages: per response [B] (broadcast over T) or per token [B, T]; constant.
        response_mask: valid response tokens, bool or 0/1; [B, T].
        clip_low, clip_high: decoupled clip range (paper: 0.2, 0.28).
        clip_c: dual-clip constant, > 1 (reference 32B run: 10); ``None`` disables it.
        loss_agg, global_tokens, global_seqs, norm_len: aggregation, see ``aggregate_loss``.
        behaviour_log_prob: log-probs recorded by the rollout engine; [B, T], or ``None``
            for on-policy data (identical to plain DAPO).
        behaviour_mask: the tokens the correction applies to (off-policy rows), bool [B, 1] or
            [B, T]; ``w = 1`` elsewhere. ``None``: every token.
        is_clip: truncation of the importance weight, > 0.

    Returns:
        ``(loss, metrics)``: the aggregated scalar loss and python floats averaged over this
        call's valid tokens (a trainer averages them over micro-batches for logging):
        ``pg_clipfrac`` (L2 > L1), ``clipfrac_high`` (ratio > 1 + clip_high with A > 0),
        ``clipfrac_low`` (ratio < 1 - clip_low with A < 0), ``pg_clipfrac_lower`` (dual clip
        active), ``ppo_kl`` (mean of old_log_prob - log_prob), ``ratio_mean``; when behaviour
        log-probs are given, ``BEHAVIOUR_METRICS`` averaged over the valid tokens of
        ``behaviour_mask`` only (0 when there are none; weigh them by that count, not by the
        valid tokens): ``is_weight_mean`` (w) and ``is_clipfrac`` (pi_old / pi_behaviour >
        is_clip, so w was truncated).

    Raises:
        ValueError: shape mismatch, out-of-range clip arguments or unknown ``loss_agg``.
    """
    _check_policy_args(
        log_prob, old_log_prob, advantages, response_mask, behaviour_log_prob, behaviour_mask
    )
    _check_clip_args(clip_low, clip_high, clip_c, is_clip)

    old_log_prob = old_log_prob.detach()
    adv = advantages.detach()
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1)  # (B, 1), broadcasts over T
    adv = adv.to(log_prob.dtype)

    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    loss1 = -adv * ratio  # (B, T)
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    loss_clip = torch.maximum(loss1, loss2)  # (B, T)
    loss_tok = loss_clip
    if clip_c is not None:
        loss_dual = torch.minimum(loss_clip, -adv * clip_c)  # (B, T)
        loss_tok = torch.where(adv < 0, loss_dual, loss_clip)  # (B, T)

    weight: Tensor | None = None
    truncated: Tensor | None = None
    corrected = torch.ones_like(log_prob, dtype=torch.bool)  # (B, T)
    if behaviour_log_prob is not None:
        limit = DEFAULT_IS_CLIP if is_clip is None else is_clip
        if behaviour_mask is not None:
            corrected = behaviour_mask.bool().expand_as(log_prob)
        behaviour_log_ratio = (old_log_prob - behaviour_log_prob.detach()).clamp(
            -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND
        )
        raw = behaviour_log_ratio.exp()  # (B, T)
        weight = torch.where(corrected, raw.clamp(max=limit), 1.0)  # (B, T)
        truncated = corrected & (raw > limit)  # (B, T)
        loss_tok = loss_tok * weight

    loss = aggregate_loss(
        loss_tok,
        response_mask,
        loss_agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )

    with torch.no_grad():
        mask = response_mask.to(torch.float32)  # (B, T)
        stats: dict[str, Tensor] = {
            "pg_clipfrac": loss2 > loss1,
            "clipfrac_high": (ratio > 1.0 + clip_high) & (adv > 0),
            "clipfrac_low": (ratio < 1.0 - clip_low) & (adv < 0),
            "pg_clipfrac_lower": (
                (adv < 0) & (loss_clip > -adv * clip_c)
                if clip_c is not None
                else torch.zeros_like(mask, dtype=torch.bool)
            ),
            "ppo_kl": old_log_prob - log_prob,
            "ratio_mean": ratio,
        }
        metrics = _masked_means(stats, mask)
        if weight is not None and truncated is not None:
            behaviour = {"is_weight_mean": weight, "is_clipfrac": truncated}
            metrics |= _masked_means(behaviour, mask * corrected)
    return loss, metrics


def combine_losses(pg: Tensor, entropy: Tensor | None = None, entropy_coef: float = 0.0) -> Tensor:
    """Total loss ``pg - entropy_coef * entropy`` from aggregated scalars.

    DAPO uses no entropy bonus (coefficient 0) and no KL term at all (docs/algorithm.md s4).
    A zero coefficient skips the term entirely, so a NaN in it cannot leak in; a non-zero
    coefficient without its term is an error.
    """
    if entropy_coef == 0.0:
        return pg
    if entropy is None:
        raise ValueError(f"entropy_coef = {entropy_coef} but no entropy term was given")
    return pg - entropy_coef * entropy
