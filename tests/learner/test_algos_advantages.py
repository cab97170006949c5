"""Group-relative advantages (docs/algorithm.md section 3) against hand values and torch.std."""

from __future__ import annotations

import pytest
import torch

from learner.algos import group_advantages


def _naive(rewards: list[float], ids: list[object], norm_by_std: bool, eps: float) -> list[float]:
    out = []
    for r, gid in zip(rewards, ids, strict=True):
        members = [x for x, g in zip(rewards, ids, strict=True) if g == gid]
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(members) / len(members)
            std = (sum((x - mean) ** 2 for x in members) / (len(members) - 1)) ** 0.5
        out.append((r - mean) / (std + eps) if norm_by_std else r - mean)
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_naive_reference_with_shuffled_groups(norm_by_std: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = [int(i) for i in torch.randint(0, 7, (60,), generator=gen)]
    rewards = torch.randn(60, generator=gen, dtype=torch.float64)
    got = group_advantages(rewards, ids, norm_by_std=norm_by_std)
    want = torch.tensor(_naive(rewards.tolist(), list(ids), norm_by_std, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got, want)


def test_unbiased_std_matches_torch_std() -> None:
    rewards = torch.tensor([1.0, -1.0, -1.0, 0.5, 1.0, -0.5], dtype=torch.float64)
    got = group_advantages(rewards, [0] * 6)
    want = (rewards - rewards.mean()) / (torch.std(rewards, unbiased=True) + 1e-6)
    torch.testing.assert_close(got, want)
    biased = (rewards - rewards.mean()) / (torch.std(rewards, unbiased=False) + 1e-6)
    assert not torch.allclose(got, biased)


def test_group_of_size_one_uses_mean_zero_std_one() -> None:
    rewards = torch.tensor([0.7, -1.0, 1.0])
    got = group_advantages(rewards, ["solo", "pair", "pair"])
    assert got[0].item() == pytest.approx(0.7 / (1.0 + 1e-6))
    got_dr = group_advantages(rewards, ["solo", "pair", "pair"], norm_by_std=False)
    assert got_dr[0].item() == pytest.approx(0.7)


def test_all_equal_rewards_give_zero() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    got = group_advantages(rewards, [0, 0, 0, 1, 1])
    assert torch.equal(got, torch.zeros(5))


def test_norm_by_std_false_is_centred_reward() -> None:
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0])
    got = group_advantages(rewards, [3, 3, 3, 3], norm_by_std=False)
    torch.testing.assert_close(got, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_string_tuple_and_tensor_ids() -> None:
    rewards = torch.tensor([1.0, -1.0, 2.0, 0.0])
    want = group_advantages(rewards, [0, 0, 1, 1])
    torch.testing.assert_close(group_advantages(rewards, ["p0", "p0", "p1", "p1"]), want)
    torch.testing.assert_close(
        group_advantages(rewards, [(0, "a"), (0, "a"), (1, 2), (1, 2)]), want
    )
    # Tensor elements hash by identity; values must still be grouped by value.
    torch.testing.assert_close(group_advantages(rewards, torch.tensor([5, 5, 9, 9])), want)


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError, match="len\\(group_ids\\)"):
        group_advantages(torch.zeros(3), [0, 0])


def test_non_float_rewards_raise() -> None:
    with pytest.raises(ValueError, match="floating"):
        group_advantages(torch.tensor([1, 0]), [0, 0])


def test_empty_batch() -> None:
    assert group_advantages(torch.zeros(0), []).shape == (0,)
