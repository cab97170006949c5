"""DAPO policy loss (docs/algorithm.md sections 4 and 9) and combine_losses."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from learner.algos import (
    LOSS_AGG_MODES,
    LossAgg,
    combine_losses,
    policy_loss,
)


def _one_token(
    ratio: float, adv: float, **kwargs: float
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Loss and d loss / d log_prob for a single valid token with the given ratio."""
    old = torch.zeros(1, 1, dtype=torch.float64)
    log_prob = torch.full((1, 1), math.log(ratio), dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        log_prob, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1), **kwargs
    )
    loss.backward()
    assert log_prob.grad is not None
    return loss.detach(), log_prob.grad, metrics


def test_positive_advantage_above_clip_high_has_zero_gradient() -> None:
    loss, grad, metrics = _one_token(ratio=1.5, adv=2.0)
    assert loss.item() == pytest.approx(-2.0 * 1.28)
    assert grad.item() == 0.0
    assert metrics["pg_clipfrac"] == 1.0
    assert metrics["clipfrac_high"] == 1.0
    assert metrics["clipfrac_low"] == 0.0


def test_clip_high_is_decoupled_from_clip_low() -> None:
    # ratio 1.25 is outside 1 + 0.2 but inside the Clip-Higher bound 1 + 0.28.
    loss, grad, metrics = _one_token(ratio=1.25, adv=1.0)
    assert loss.item() == pytest.approx(-1.25)
    assert grad.item() == pytest.approx(-1.25)  # d(-A * exp(logp - old)) / d logp
    assert metrics["pg_clipfrac"] == 0.0


def test_negative_advantage_below_clip_low_has_zero_gradient() -> None:
    loss, grad, metrics = _one_token(ratio=0.5, adv=-1.0)
    assert loss.item() == pytest.approx(0.8)
    assert grad.item() == 0.0
    assert metrics["clipfrac_low"] == 1.0
    assert metrics["clipfrac_high"] == 0.0


def test_negative_advantage_large_ratio_unclipped_without_dual_clip() -> None:
    loss, grad, metrics = _one_token(ratio=30.0, adv=-1.0)
    assert loss.item() == pytest.approx(30.0)
    assert grad.item() == pytest.approx(30.0)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_dual_clip_caps_negative_advantage_loss() -> None:
    loss, grad, metrics = _one_token(ratio=30.0, adv=-0.5, clip_c=10.0)
    assert loss.item() == pytest.approx(0.5 * 10.0)
    assert grad.item() == 0.0
    assert metrics["pg_clipfrac_lower"] == 1.0
    # Below the cap the dual clip changes nothing.
    loss, grad, metrics = _one_token(ratio=3.0, adv=-0.5, clip_c=10.0)
    assert loss.item() == pytest.approx(1.5)
    assert grad.item() == pytest.approx(1.5)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_dual_clip_ignores_positive_advantage() -> None:
    # For A > 0, min(Lclip, -A * c) would give -3; the max(L1, L2) = L1 = -0.01 must stay.
    loss, _, metrics = _one_token(ratio=0.01, adv=1.0, clip_c=3.0)
    assert loss.item() == pytest.approx(-0.01)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_clip_c_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="clip_c"):
        _one_token(ratio=1.0, adv=1.0, clip_c=1.0)


def test_metrics_on_hand_built_batch() -> None:
    # Row 0: four valid tokens; row 1: fully masked (must not count anywhere).
    ratios = torch.tensor([[1.5, 0.5, 30.0, 1.0], [9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    log_prob = old + ratios.log()
    loss, m = policy_loss(log_prob, old, adv, mask, clip_c=10.0)
    # token losses: -1.28 (clipped high), 0.8 (clipped low), 10 (dual clip), -1.0
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 10.0 - 1.0) / 4)
    assert m["pg_clipfrac"] == pytest.approx(2 / 4)  # tokens 0 and 1
    assert m["clipfrac_high"] == pytest.approx(1 / 4)
    assert m["clipfrac_low"] == pytest.approx(1 / 4)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 4)
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in (1.5, 0.5, 30.0, 1.0)) / 4)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 30.0 + 1.0) / 4)
    assert "is_weight_mean" not in m
    assert all(isinstance(v, float) for v in m.values())


def _random_case(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 8
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    log_prob = old + 0.6 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) > 0.3
    mask[2] = False
    return log_prob, old, adv, mask


def _naive_token_loss(lp: float, old: float, a: float, clip_c: float | None) -> float:
    ratio = math.exp(max(min(lp - old, 20.0), -20.0))
    clipped = min(max(ratio, 0.8), 1.28)
    value = max(-a * ratio, -a * clipped)
    if clip_c is not None and a < 0:
        value = min(value, -a * clip_c)
    return value


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip_c", [None, 1.5])
def test_matches_naive_reference(mode: LossAgg, clip_c: float | None) -> None:
    log_prob, old, adv, mask = _random_case(seed=3)
    b, t = mask.shape
    rows = []
    for i in range(b):
        row = [
            _naive_token_loss(float(log_prob[i, j]), float(old[i, j]), float(adv[i]), clip_c)
            for j in range(t)
            if mask[i, j]
        ]
        rows.append(row)
    flat = [x for row in rows for x in row]
    non_empty = [row for row in rows if row]
    want = {
        "token-mean": sum(flat) / len(flat),
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in non_empty) / len(non_empty),
        "seq-mean-token-sum": sum(sum(r) for r in non_empty) / len(non_empty),
        "seq-mean-token-sum-norm": sum(flat) / t,
    }[mode]
    got, _ = policy_loss(log_prob, old, adv, mask, clip_c=clip_c, loss_agg=mode)
    assert got.item() == pytest.approx(want, rel=1e-12)


def test_per_response_and_per_token_advantages_agree() -> None:
    log_prob, old, adv, mask = _random_case(seed=5)
    a, ma = policy_loss(log_prob, old, adv, mask)
    b, mb = policy_loss(log_prob, old, adv.unsqueeze(-1).expand_as(log_prob), mask)
    assert a.item() == b.item()
    assert ma == mb


def test_behaviour_equal_to_old_is_plain_dapo() -> None:
    log_prob, old, adv, mask = _random_case(seed=6)
    lp1 = log_prob.clone().requires_grad_(True)
    lp2 = log_prob.clone().requires_grad_(True)
    plain, m_plain = policy_loss(lp1, old, adv, mask, clip_c=3.0)
    corrected, m_corr = policy_loss(lp2, old, adv, mask, clip_c=3.0, behaviour_log_prob=old)
    plain.backward()
    corrected.backward()
    assert corrected.item() == plain.item()
    assert torch.equal(lp1.grad, lp2.grad)  # type: ignore[arg-type]
    assert m_corr.pop("is_weight_mean") == pytest.approx(1.0)
    assert m_corr.pop("is_clipfrac") == 0.0
    assert m_corr == m_plain


def test_importance_weight_scales_and_truncates() -> None:
    log_prob, old, adv, mask = _random_case(seed=8)
    plain, _ = policy_loss(log_prob, old, adv, mask)
    # pi_old / pi_behaviour = 0.5 everywhere: below the clip, applied as is.
    half, m = policy_loss(log_prob, old, adv, mask, behaviour_log_prob=old - math.log(0.5))
    assert half.item() == pytest.approx(0.5 * plain.item(), rel=1e-12)
    assert m["is_weight_mean"] == pytest.approx(0.5)
    # Ratio 5 is truncated at the default is_clip = 2 ...
    trunc, m = policy_loss(log_prob, old, adv, mask, behaviour_log_prob=old - math.log(5.0))
    assert trunc.item() == pytest.approx(2.0 * plain.item(), rel=1e-12)
    assert m["is_weight_mean"] == pytest.approx(2.0)
    # ... and at an explicit one.
    trunc3, _ = policy_loss(
        log_prob, old, adv, mask, behaviour_log_prob=old - math.log(5.0), is_clip=3.0
    )
    assert trunc3.item() == pytest.approx(3.0 * plain.item(), rel=1e-12)


def test_the_weight_and_its_metrics_cover_the_off_policy_rows_only() -> None:
    """Rows 0-1 off-policy: ratio 5 (truncated at 2) and 0.5; rows 3-5 on-policy, whose
    behaviour log-probs (here garbage) must neither weigh their loss nor enter the metrics."""
    log_prob, old, adv, mask = _random_case(seed=11)
    behaviour = old - 7.0
    behaviour[0], behaviour[1] = old[0] - math.log(5.0), old[1] - math.log(0.5)
    off = torch.tensor([[True], [True], [False], [False], [False], [False]])
    loss, m = policy_loss(
        log_prob, old, adv, mask, behaviour_log_prob=behaviour, behaviour_mask=off
    )
    # The same loss as on-policy rows given pi_behaviour := pi_old (w = 1 exactly there).
    want, _ = policy_loss(
        log_prob, old, adv, mask, behaviour_log_prob=torch.where(off, behaviour, old)
    )
    assert loss.item() == want.item()
    n0, n1 = int(mask[0].sum()), int(mask[1].sum())
    assert m["is_weight_mean"] == pytest.approx((2.0 * n0 + 0.5 * n1) / (n0 + n1))
    assert m["is_clipfrac"] == pytest.approx(n0 / (n0 + n1))
    # No off-policy token: the means ran over nothing and are 0 (the trainer weighs them by 0).
    _, none = policy_loss(
        log_prob, old, adv, mask, behaviour_log_prob=behaviour, behaviour_mask=off & False
    )
    assert none["is_weight_mean"] == 0.0 and none["is_clipfrac"] == 0.0


def test_importance_weight_carries_no_gradient() -> None:
    log_prob, old, adv, mask = _random_case(seed=9)
    behaviour = (old - 0.1).requires_grad_(True)
    loss, _ = policy_loss(
        log_prob.requires_grad_(True), old, adv, mask, behaviour_log_prob=behaviour
    )
    loss.backward()
    assert behaviour.grad is None


def test_is_clip_without_behaviour_is_ignored() -> None:
    log_prob, old, adv, mask = _random_case(seed=10)
    plain, m1 = policy_loss(log_prob, old, adv, mask)
    same, m2 = policy_loss(log_prob, old, adv, mask, is_clip=5.0)
    assert plain.item() == same.item()
    assert m1 == m2


def test_shape_errors() -> None:
    log_prob, old, adv, mask = _random_case(seed=0)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(log_prob, old, adv[:3], mask)
    with pytest.raises(ValueError, match="old_log_prob"):
        policy_loss(log_prob, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="behaviour_log_prob"):
        policy_loss(log_prob, old, adv, mask, behaviour_log_prob=old[:2])


# --------------------------------------------------------------------------------------------
# Combination of loss terms (DAPO: no KL term, no entropy bonus by default).


def test_combine_losses() -> None:
    pg, ent = torch.tensor(1.0), torch.tensor(2.0)
    assert combine_losses(pg).item() == 1.0
    assert combine_losses(pg, ent).item() == 1.0  # DAPO default: coefficient 0
    assert combine_losses(pg, ent, entropy_coef=0.01).item() == pytest.approx(1.0 - 0.02)
    assert (
        combine_losses(pg, torch.tensor(float("nan"))).item() == 1.0
    )  # a skipped term cannot leak NaN
    with pytest.raises(ValueError, match="entropy_coef"):
        combine_losses(pg, entropy_coef=0.1)
