"""Per-GPU memory budget of a config, from the model's `config.json` and the cluster shape.

What `dapo run --dry-run` prints next to the placement, and what the preset table of
docs/sizing.md shows. These are estimates from first principles, meant to tell "fits" from
"does not fit" before renting GPUs, not to predict the allocator to the megabyte:

- Learner rank (FSDP2 over `learner.nproc` ranks): fp32 master parameters, fp32 gradients and
  AdamW's two fp32 moments, each sharded (16 bytes per parameter / ranks); the all-gathered
  compute copy of one decoder layer (two with prefetch) and of the unsharded root (embeddings and
  output head) in the compute dtype; activations of one micro-batch of
  `micro_batch_size` sequences of `max_prompt_len + max_response_len` tokens: what autograd keeps
  per token of a Qwen2/Llama decoder layer with flash attention (`ModelShape.activation_bytes`,
  counted tensor by tensor), or only each layer's input with `learner.activation_checkpointing`
  (plus one layer's activations while it is recomputed); and the output logits of the
  micro-batch in fp32 (with their gradient), an upper bound now that the trainer computes
  log-probs in chunks.
- Rollout replica (tensor-parallel over `rollout.tensor_parallel_size` GPUs): the weights in
  `model.dtype` split over the GPUs, and what is left of `gpu_memory_utilization` for the KV
  cache, expressed as how many full-length sequences fit at once, against the sequences one
  generation batch holds (`prompts_per_batch x group_size`); more than fit run in waves.
- With LoRA (`learner.lora`): the frozen base in the compute dtype (2 bytes a parameter under
  bf16), sharded, and fp32 adapters with their gradients and AdamW moments (16 bytes an adapter
  parameter); activations as above (the backward still runs through every layer). A weight sync
  sends the adapters alone (`sync_bytes`).

`tests/services/test_plan_memory.py` checks the learner's parts against memory measured on a
CPU for a model that fits this machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.config import DapoConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> ModelShape:
        return cls(
            hidden=int(raw["hidden_size"]),
            layers=int(raw["num_hidden_layers"]),
            heads=int(raw["num_attention_heads"]),
            kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            intermediate=int(raw["intermediate_size"]),
            vocab=int(raw["vocab_size"]),
            tied=bool(raw.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelShape:
        return cls.from_config(json.loads(Path(path).read_text()))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (
            self.heads * 2 + self.kv_heads * 2
        ) + self.head_dim * (self.heads + 2 * self.kv_heads)
        return (
            attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        )  # q,k,v,o (+bias), MLP, norms

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear module of one Qwen2/Llama decoder layer."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_dim, self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters over every layer: rank x (in + out) per targeted module (A and B).
        Raises for a target this shape does not have."""
        dims = self.module_dims()
        unknown = sorted(set(targets) - set(dims))
        if unknown:
            raise ValueError(f"learner.lora.target_modules: no module {unknown} in the model")
        return self.layers * sum(rank * sum(dims[t]) for t in targets)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache of one token over every layer (keys and values)."""
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def activation_bytes(self, compute_bytes: int) -> int:
        """What autograd keeps per token of one decoder layer for the backward pass, with flash
        (or SDPA) attention, so nothing grows with the sequence length. Counted tensor by tensor
        for the Qwen2/Llama layer: q (after RoPE), k, v, the attention output and its contiguous
        copy into o_proj (3h + 2kv); the SwiGLU MLP's gate, up, SiLU(gate) and their product
        (4 x intermediate), all in the compute dtype; and each of the two RMSNorms, which keep
        their input in fp32 and their normalised output in the compute dtype (4h + compute x h)."""
        h = self.hidden
        return compute_bytes * (3 * h + 2 * self.kv_dim + 4 * self.intermediate) + 2 * (
            4 * h + compute_bytes * h
        )


@dataclass(frozen=True)
class Budget:
    """GiB per GPU, by part."""

    learner: dict[str, float]
    replica: dict[str, float]
    concurrent_sequences: int
    """Full-length sequences one replica's KV cache holds at once
    (0: the weights alone do not fit)."""
    batch_sequences: int = 0
    """Sequences of one generation batch (`prompts_per_batch x group_size`): above
    `concurrent_sequences` they are generated in waves, and the long tail costs more."""

    @property
    def learner_total(self) -> float:
        return sum(self.learner.values())

    @property
    def replica_total(self) -> float:
        return sum(self.replica.values())

    def fits(self, gpu_gib: float) -> bool:
        return self.learner_total <= gpu_gib and self.concurrent_sequences >= 1

    def describe(self, gpu_gib: float) -> str:
        lines = [
            f"learner, per GPU: {self.learner_total:.1f} GiB ("
            + ", ".join(f"{k} {v:.1f}" for k, v in self.learner.items())
            + ")"
        ]
        lines.append(
            f"rollout replica, per GPU: {self.replica_total:.1f} GiB ("
            + ", ".join(f"{k} {v:.1f}" for k, v in self.replica.items())
            + f"); the KV cache holds {self.concurrent_sequences} full-length sequences"
            + (
                f" of the {self.batch_sequences} a generation batch has"
                if self.batch_sequences
                else ""
            )
        )
        verdict = "fits" if self.fits(gpu_gib) else "does NOT fit"
        lines.append(f"on {gpu_gib:.0f} GiB GPUs this {verdict}")
        return "\n".join(lines)


def trained_params(cfg: DapoConfig, shape: ModelShape) -> int:
    """Parameters the learner trains: every one, or the LoRA adapters'."""
    lora = cfg.learner.lora
    return shape.lora_params(lora.rank, lora.target_modules) if lora.enabled else shape.params


def sync_bytes(cfg: DapoConfig, shape: ModelShape) -> int:
    """Bytes one weight sync sends each replica (`model.dtype`): the model, or the adapters."""
    return DTYPE_BYTES[cfg.model.dtype] * trained_params(cfg, shape)


def budget(cfg: DapoConfig, shape: ModelShape, gpu_gib: float) -> Budget:
    le, ro = cfg.learner, cfg.rollout
    n, ranks = shape.params, le.nproc
    compute = 2 if le.mixed_precision != "none" else 4  # bf16 on GPU under "auto"
    response = ro.max_response_len + ro.tools.inserted_tokens_max  # tool results are context
    tokens = le.micro_batch_size * (cfg.data.max_prompt_len + response)
    per_layer = shape.activation_bytes(compute)
    if (
        le.activation_checkpointing
    ):  # each layer's input, plus one layer's activations during its recomputation
        activations = tokens * (shape.hidden * compute * shape.layers + per_layer)
    else:
        activations = tokens * per_layer * shape.layers
    trained = trained_params(cfg, shape)
    frozen = n if le.lora.enabled else 0  # LoRA: the base, kept in the compute dtype
    learner = {
        "parameters": (compute * frozen + 4 * trained) / ranks / GIB,
        "gradients": 4 * trained / ranks / GIB,
        "optimizer": 8 * trained / ranks / GIB,
        "gathered": compute * (2 * shape.layer_params + shape.root_params) / GIB,
        "activations": activations / GIB,
        "logits": 2 * 4 * le.micro_batch_size * response * shape.vocab / GIB,
    }
    weights = DTYPE_BYTES[cfg.model.dtype] * n / ro.tensor_parallel_size / GIB
    kv_per_token = shape.kv_bytes_per_token(DTYPE_BYTES[cfg.model.dtype]) / ro.tensor_parallel_size
    kv_gib = max(ro.gpu_memory_utilization * gpu_gib - weights, 0.0)
    sequences = int(kv_gib * GIB // (kv_per_token * (cfg.data.max_prompt_len + response)))
    return Budget(
        learner,
        {"weights": weights, "kv cache": kv_gib},
        sequences,
        ro.prompts_per_batch * ro.group_size,
    )
