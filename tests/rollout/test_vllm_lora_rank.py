"""`vllm_max_lora_rank`: the `max_lora_rank` a replica's vLLM engine is sized for. vLLM accepts
only a few values, so the adapters' rank is rounded up to the next one; the rounding is pure and
needs no vLLM (`rollout.vllm_engine` imports vLLM only inside the engine)."""

from __future__ import annotations

import importlib.util
import typing

import pytest

from rollout.vllm_engine import VLLM_LORA_RANKS, vllm_max_lora_rank


@pytest.mark.parametrize(
    ("rank", "sized_for"),
    [(1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (17, 32), (48, 64), (257, 320), (321, 512)],
)
def test_a_rank_is_rounded_up_to_the_next_rank_vllm_accepts(rank: int, sized_for: int) -> None:
    assert vllm_max_lora_rank(rank) == sized_for


def test_every_rank_up_to_512_fits_the_smallest_accepted_rank_that_holds_it() -> None:
    for rank in range(1, 513):
        got = vllm_max_lora_rank(rank)
        assert got in VLLM_LORA_RANKS and got >= rank
        assert all(r < rank for r in VLLM_LORA_RANKS if r < got)


def test_a_rank_past_512_is_refused_with_the_setting_named() -> None:
    with pytest.raises(ValueError, match=r"learner\.lora\.rank=513"):
        vllm_max_lora_rank(513)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_accepted_ranks_are_the_installed_vllms() -> None:
    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS
