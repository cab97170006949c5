"""Group-relative advantages (docs/algorithm.md section 3, GRPO style).

For the responses of one prompt group with scalar rewards ``R_1..R_G``::

    A_i = (R_i - mean(R)) / (std(R) + eps)      std unbiased (divides by G - 1)

A group of size 1 has, by definition, ``mean = 0`` and ``std = 1``, so its advantage is
``R / (1 + eps)`` (and ``R`` with ``norm_by_std=False``). This follows the reference
implementation literally: a lone response is not centred, it keeps the sign of its reward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["group_advantages"]


def _group_index(group_ids: Sequence[Hashable] | Tensor, device: torch.device) -> Tensor:
    """Map arbitrary hashable group ids to dense integer indices ``0..n_groups-1``; [N]."""
    if isinstance(group_ids, Tensor):
        # Elements of a tensor hash by identity, not value: go through python scalars.
        ids: Sequence[Hashable] = group_ids.tolist()
    else:
        ids = group_ids
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(gid, len(dense)) for gid in ids]
    return torch.tensor(index, dtype=torch.long, device=device)


def group_advantages(
    rewards: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-normalised advantage of every response.

    Args:
        rewards: scalar reward per response, float; [N].
        group_ids: the prompt ``group_id`` of each response; length N. Any hashable values
            (ints, strings, tuples); a tensor of ids is also accepted.
        norm_by_std: divide by ``std + eps`` (GRPO / DAPO). ``False`` gives the Dr.GRPO
            variant ``A_i = R_i - mean(R)``.
        eps: added to the standard deviation, 1e-6 in the paper.

    Returns:
        Advantages; [N], same dtype and device as ``rewards``. The caller broadcasts each one
        over the tokens of its response.

    Raises:
        ValueError: ``rewards`` is not a 1-D floating tensor, or ``len(group_ids) != N``.
    """
    if rewards.ndim != 1 or not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be a 1-D floating tensor, got shape {tuple(rewards.shape)} "
            f"dtype {rewards.dtype}"
        )
    n = rewards.shape[0]
    if len(group_ids) != n:
        raise ValueError(f"len(group_ids) = {len(group_ids)} but rewards has {n} entries")
    if n == 0:
        return rewards.clone()

    index = _group_index(group_ids, rewards.device)  # (N,)
    n_groups = int(index.max().item()) + 1
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)

    count = zeros.index_add(0, index, torch.ones_like(rewards))  # (G,)
    total = zeros.index_add(0, index, rewards)  # (G,)
    singleton = count < 2  # (G,)
    mean = torch.where(singleton, zeros, total / count)  # (G,)
    centred = rewards - mean[index]  # (N,)
    if not norm_by_std:
        return centred

    # Two-pass variance: numerically safer than E[x^2] - E[x]^2 for near-equal rewards.
    sq = zeros.index_add(0, index, centred.square())  # (G,)
    var = sq / (count - 1).clamp(min=1)  # (G,) unbiased
    std = torch.where(singleton, torch.ones_like(var), var.sqrt())  # (G,)
    return centred / (std[index] + eps)  # (N,)
