"""Loss aggregation modes (docs/algorithm.md section 5): naive references and split invariance.

The invariance tests are the guard on the known trap: token-mean must be normalised by the
token count of the whole mini-batch, not of each micro-batch or rank.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from learner.algos import (
    LOSS_AGG_MODES,
    LossAgg,
    aggregate_loss,
    count_seqs,
    count_tokens,
    policy_loss,
)

B, T = 12, 9


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    """Random loss [B, T] and a ragged mask [B, T] with some fully masked rows."""
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[0], lengths[5] = 0, 0  # fully masked rows
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    # Holes inside responses too (e.g. tool output tokens), not only right padding.
    mask &= torch.rand(B, T, generator=gen) > 0.15
    return loss, mask


def _naive(loss: Tensor, mask: Tensor, mode: str, norm_len: float | None = None) -> float:
    rows = [
        [float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t]]
        for b in range(loss.shape[0])
    ]
    if mode == "token-mean":
        tokens = [x for row in rows for x in row]
        return sum(tokens) / max(len(tokens), 1)
    if mode == "seq-mean-token-mean":
        means = [sum(row) / len(row) for row in rows if row]
        return sum(means) / max(len(means), 1)
    if mode == "seq-mean-token-sum":
        sums = [sum(row) for row in rows if row]
        return sum(sums) / max(len(sums), 1)
    assert mode == "seq-mean-token-sum-norm"
    return sum(x for row in rows for x in row) / (norm_len or loss.shape[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_matches_naive_reference(mode: LossAgg, seed: int) -> None:
    loss, mask = _batch(seed)
    got = aggregate_loss(loss, mask, mode)
    assert got.item() == pytest.approx(_naive(loss, mask, mode), rel=1e-12, abs=1e-12)
    # A float 0/1 mask behaves like the bool mask.
    got_float = aggregate_loss(loss, mask.double(), mode)
    assert got_float.item() == pytest.approx(got.item(), rel=1e-12, abs=1e-12)


def test_norm_len_overrides_padded_length() -> None:
    loss, mask = _batch(3)
    got = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=100.0)
    assert got.item() == pytest.approx(_naive(loss, mask, "seq-mean-token-sum-norm", 100.0))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_gives_zero_not_nan(mode: LossAgg) -> None:
    loss = torch.randn(3, 4)
    got = aggregate_loss(loss, torch.zeros(3, 4, dtype=torch.bool), mode)
    assert got.item() == 0.0


def test_counts() -> None:
    _, mask = _batch(0)
    assert count_tokens(mask) == int(mask.sum())
    assert count_seqs(mask) == sum(1 for b in range(B) if mask[b].any())
    assert count_seqs(mask) < B  # the fully masked rows are not counted


def test_unknown_mode_lists_valid_modes() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate_loss(torch.zeros(2, 2), torch.ones(2, 2), "mean")  # type: ignore[arg-type]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="B, T"):
        aggregate_loss(torch.zeros(2, 2), torch.ones(2, 3), "token-mean")
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate_loss(torch.zeros(2, 2), torch.ones(2, 2), "token-mean", global_tokens=-1.0)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate_loss(torch.zeros(2, 2), torch.ones(2, 2), "seq-mean-token-sum-norm", norm_len=0)


# --------------------------------------------------------------------------------------------
# Split invariance: micro-batches and simulated data-parallel ranks.

# Each layout is a list of ranks; each rank is a list of micro-batch row counts (sum = B).
LAYOUTS = {
    "micro-1-5-6": [[1, 5, 6]],
    "micro-4x3": [[3, 3, 3, 3]],
    "2-ranks": [[2, 4], [5, 1]],
    "4-ranks": [[3], [1, 2], [2, 1], [1, 2]],
}


def _pieces(layout: list[list[int]]) -> list[list[slice]]:
    out, start = [], 0
    for rank in layout:
        slices = []
        for size in rank:
            slices.append(slice(start, start + size))
            start += size
        out.append(slices)
    assert start == B
    return out


class _Setup:
    """A tiny shared-parameter "policy": log_prob = logsigmoid(features @ theta); [B, T]."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        _, self.mask = _batch(seed)
        self.features = torch.randn(B, T, 4, generator=gen, dtype=torch.float64)
        self.theta0 = torch.randn(4, generator=gen, dtype=torch.float64)
        self.old = torch.nn.functional.logsigmoid(self.features @ self.theta0).detach()
        self.old += 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
        self.adv = torch.randn(B, generator=gen, dtype=torch.float64)

    def loss(
        self, theta: Tensor, rows: slice, mode: LossAgg, counts: dict[str, float] | None = None
    ) -> Tensor:
        log_prob = torch.nn.functional.logsigmoid(self.features[rows] @ theta)  # (b, T)
        counts = counts or {}
        loss, _ = policy_loss(
            log_prob,
            self.old[rows],
            self.adv[rows],
            self.mask[rows],
            loss_agg=mode,
            global_tokens=counts.get("global_tokens"),
            global_seqs=counts.get("global_seqs"),
            norm_len=counts.get("norm_len"),
        )
        return loss


def _grad(fn: Callable[[Tensor], Tensor], theta0: Tensor) -> tuple[float, Tensor]:
    theta = theta0.clone().requires_grad_(True)
    value = fn(theta)
    value.backward()
    assert theta.grad is not None
    return value.item(), theta.grad


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sum_over_pieces_equals_full_batch(mode: LossAgg, layout: str) -> None:
    s = _Setup(seed=7)
    full_value, full_grad = _grad(lambda th: s.loss(th, slice(0, B), mode), s.theta0)

    ranks = _pieces(LAYOUTS[layout])
    # What the trainer all-reduces (SUM) before the first micro-batch.
    counts = {
        "global_tokens": float(sum(count_tokens(s.mask[p]) for r in ranks for p in r)),
        "global_seqs": float(sum(count_seqs(s.mask[p]) for r in ranks for p in r)),
        "norm_len": float(T),
    }
    world = len(ranks)
    value, rank_grads = 0.0, []
    for rank in ranks:
        # Gradient accumulation on one rank: backward per micro-batch, grads add up.
        theta = s.theta0.clone().requires_grad_(True)
        for rows in rank:
            piece = s.loss(theta, rows, mode, counts)
            value += piece.item()
            (piece * world).backward()  # gradients are AVERAGED across ranks below
        assert theta.grad is not None
        rank_grads.append(theta.grad)
    averaged = torch.stack(rank_grads).mean(dim=0)  # what DDP's all-reduce produces

    assert value == pytest.approx(full_value, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(averaged, full_grad, rtol=1e-6, atol=1e-9)


def test_log_prob_gradient_matches_over_micro_batches() -> None:
    """Gradient w.r.t. the log-probs themselves (not only a shared parameter)."""
    s = _Setup(seed=11)
    log_prob = torch.nn.functional.logsigmoid(s.features @ s.theta0).detach()
    full = log_prob.clone().requires_grad_(True)
    policy_loss(full, s.old, s.adv, s.mask)[0].backward()

    pieced = log_prob.clone().requires_grad_(True)
    total = float(count_tokens(s.mask))
    for rows in _pieces([[2, 7, 3]])[0]:
        loss, _ = policy_loss(
            pieced[rows], s.old[rows], s.adv[rows], s.mask[rows], global_tokens=total
        )
        loss.backward()
    assert full.grad is not None and pieced.grad is not None
    torch.testing.assert_close(pieced.grad, full.grad, rtol=1e-6, atol=1e-12)


def test_naive_per_micro_batch_token_mean_does_not_match() -> None:
    """The trap: averaging (or summing) local token means is not the token mean."""
    loss, mask = _batch(4)
    full = aggregate_loss(loss, mask, "token-mean").item()
    pieces = _pieces([[1, 5, 6]])[0]
    local = [aggregate_loss(loss[p], mask[p], "token-mean").item() for p in pieces]
    assert sum(local) / len(local) != pytest.approx(full, rel=1e-3)
    assert sum(local) != pytest.approx(full, rel=1e-3)
    total = float(count_tokens(mask))
    fixed = [
        aggregate_loss(loss[p], mask[p], "token-mean", global_tokens=total).item() for p in pieces
    ]
    assert sum(fixed) == pytest.approx(full, rel=1e-12)
