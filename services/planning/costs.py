"""What the pipeline's work costs on given GPUs, from the model's shape: the hardware half of
`dapo plan` (the simulation is the other half, and takes these costs as inputs).

- A decode step of a replica reads its weights and the KV cache of its active sequences once
  (memory-bound at small batches) and does 2 x params FLOPs per sequence (compute-bound at large
  ones): `DecodeModel.step_seconds`. A generation batch runs its sequences in at most `slots`
  at a time (vLLM's `max_num_seqs`, and what the KV cache holds); the batch ends with its
  longest response, so its time is a sweep over the responses' lengths in which the number of
  active sequences falls as they finish (`DecodeModel.batch_seconds`): the long tail.
- A learner step costs 6 x params FLOPs per token (8 with activation checkpointing), plus
  attention, at a fraction `train_mfu` of the GPUs' dense bf16 peak (`train_seconds`).
- A weight sync moves the bf16 weights once over the slowest link between the learner and the
  replicas (`sync_seconds`).
- Response lengths follow a log-normal law with its mean a fraction of `max_response_len`,
  clipped at the maximum (`ResponseLengths`): the shape of DAPO's length histograms, a bulk and
  a tail up to the limit.

Every efficiency is one number in `Assumptions`, the same for every preset and every published
system `calibration` compares against (docs/planning.md lists them and why).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from services.planning.capacity import ModelShape
from services.planning.hardware import GpuType


@dataclass(frozen=True)
class Assumptions:
    """The efficiencies the hardware model assumes, one set for every case."""

    train_mfu: float = 0.35
    """Share of the dense bf16 peak the learner's forward and backward reach (FSDP, long
    sequences, padding-free batches: 30-45% in published training reports)."""
    decode_bandwidth: float = 0.7
    """Share of the memory bandwidth a decode step reaches reading weights and KV cache."""
    decode_mfu: float = 0.4
    """Share of the dense peak a decode step's GEMMs reach when the batch is large enough to be
    compute-bound."""
    decode_step_overhead_s: float = 0.004
    """Per decode step: scheduling, sampling, kernel launches (CUDA graphs keep it small)."""
    allreduce_latency_s: float = 10e-6
    """Per tensor-parallel all-reduce; a decoder layer does two per step."""
    max_num_seqs: int = 256
    """vLLM's default cap on the sequences a replica decodes at once."""
    response_mean_fraction: float = 0.3
    """Mean response length as a share of `max_response_len` (DAPO's runs: 0.2-0.4 of the limit
    over most of training)."""
    response_sigma: float = 0.8
    """Log-normal shape of the bulk of response lengths (the longest of a few thousand is 6-8x
    the median)."""
    truncated_fraction: float = 0.01
    """Share of responses that run to `max_response_len` (DAPO's clip ratio: about 1% once the
    overlong penalty has acted, more early on)."""
    link_efficiency: float = 0.7
    """Share of a link's bandwidth a weight broadcast reaches."""


DEFAULT_ASSUMPTIONS = Assumptions()


@dataclass(frozen=True)
class ResponseLengths:
    """Response lengths: a log-normal bulk, clipped at `max_len`, plus a share `truncated` that
    runs to the limit (RL policies fall into repetition loops; DAPO's `response_length/clip_ratio`
    is this share). `mean` is the mean over all responses."""

    mean: float
    max_len: int
    sigma: float = 0.8
    truncated: float = 0.0

    @classmethod
    def assumed(cls, max_len: int, assumptions: Assumptions) -> ResponseLengths:
        return cls(
            assumptions.response_mean_fraction * max_len,
            max_len,
            assumptions.response_sigma,
            assumptions.truncated_fraction,
        )

    def with_mean(self, mean: float) -> ResponseLengths:
        return ResponseLengths(mean, self.max_len, self.sigma, self.truncated)

    @property
    def bulk_mean(self) -> float:
        return max((self.mean - self.truncated * self.max_len) / (1 - self.truncated), 1.0)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        if self.sigma == 0 and self.truncated == 0:
            return [min(max(round(self.mean), 1), self.max_len)] * n
        mu = math.log(self.bulk_mean) - self.sigma**2 / 2
        return [
            self.max_len
            if rng.random() < self.truncated
            else min(max(round(rng.lognormvariate(mu, self.sigma)), 1), self.max_len)
            for _ in range(n)
        ]


@dataclass(frozen=True)
class DecodeModel:
    """One replica's decode speed: the model's shape on `tp` GPUs of one type."""

    shape: ModelShape
    gpu: GpuType
    tp: int
    prompt_len: int
    mean_response: float
    assumptions: Assumptions
    gpu_memory_utilization: float = 0.85
    dtype_bytes: int = 2
    time_scale: float = 1.0
    """Measured over modelled decode time, where a measured generation time calibrates the model."""

    @property
    def slots(self) -> int:
        """Sequences decoded at once: vLLM's cap, or what the KV cache holds at the mean length
        (paged attention allocates as tokens come, so the mean, not the maximum, decides)."""
        weights = self.dtype_bytes * self.shape.params
        kv_bytes = self.gpu_memory_utilization * self.gpu.memory_gib * 2**30 * self.tp - weights
        per_sequence = self.shape.kv_bytes_per_token(self.dtype_bytes) * (
            self.prompt_len + self.mean_response
        )
        return max(1, min(self.assumptions.max_num_seqs, int(kv_bytes // per_sequence)))

    def step_seconds(self, active: int, context: float) -> float:
        """One decode step of `active` sequences
        whose KV caches hold `context` tokens on average."""
        a, gpu, tp = self.assumptions, self.gpu, self.tp
        weights = self.dtype_bytes * self.shape.params / tp
        kv = active * context * self.shape.kv_bytes_per_token(self.dtype_bytes) / tp
        memory = (weights + kv) / (gpu.hbm_bytes_per_s * a.decode_bandwidth)
        compute = 2 * self.shape.params * active / (tp * gpu.flops * a.decode_mfu)
        allreduce = 2 * self.shape.layers * a.allreduce_latency_s if tp > 1 else 0.0
        return self.time_scale * (max(memory, compute) + allreduce + a.decode_step_overhead_s)

    def prefill_seconds(self, prompts: int) -> float:
        """Prompt tokens of `prompts` prompts
        (each once: the G responses share its prefix cache)."""
        flops = 2 * self.shape.params * prompts * self.prompt_len
        return self.time_scale * flops / (self.tp * self.gpu.flops * self.assumptions.train_mfu)

    def batch_seconds(self, lengths: Sequence[int], prompts: int) -> float:
        """Time to generate responses of these lengths as one batch: at most `slots` at once, a
        waiting response starting as soon as one finishes, the batch done with its last token."""
        slots = self.slots
        order = list(lengths)
        if not order:
            return 0.0
        context = self.prompt_len + sum(order) / len(order) / 2
        ends: list[int] = []  # decode step at which each active response finishes
        for length in order[:slots]:
            heapq.heappush(ends, length)
        waiting = order[slots:][::-1]
        step, seconds = 0, 0.0
        while ends:
            end = heapq.heappop(ends)
            seconds += (end - step) * self.step_seconds(len(ends) + 1, context)
            step = end
            if waiting:
                heapq.heappush(ends, step + waiting.pop())
        return seconds + self.prefill_seconds(prompts)


def train_seconds(
    shape: ModelShape,
    tokens: float,
    mean_seq_len: float,
    gpus: int,
    gpu: GpuType,
    assumptions: Assumptions,
    *,
    checkpointing: bool,
    recompute_logprobs: bool = False,
    frozen_base: bool = False,
) -> float:
    """One learner step over `tokens` tokens (prompts and responses) on `gpus` GPUs.

    FLOPs per token: 6 x params for forward and backward (4 with a frozen base: LoRA), +2 x
    params to recompute activations with checkpointing, +2 x params for a separate forward that
    recomputes the behaviour log-probs (verl's `old_log_prob`; this project takes them from the
    replicas); attention adds
    12 x layers x hidden x (mean causal context, half the sequence) per token for forward and
    backward."""
    # With a frozen base (LoRA) the backward computes no weight gradients: 2 x params fewer
    # (the adapters' own FLOPs are a rounding error at the ranks used).
    passes = (4 if frozen_base else 6) + (2 if checkpointing else 0)
    passes += 2 if recompute_logprobs else 0
    attention = 12 * shape.layers * shape.hidden * mean_seq_len / 2 * (passes / 6)
    flops = tokens * (passes * shape.params + attention)
    return flops / (gpus * gpu.flops * assumptions.train_mfu)


def sync_seconds(
    shape: ModelShape,
    gpu: GpuType,
    cluster_gpus: int,
    assumptions: Assumptions,
    *,
    nbytes: float | None = None,
) -> float:
    """Broadcasting the bf16 weights (or `nbytes`: LoRA's adapters) from the learner to the
    replicas (pipelined, so about one pass over the slowest link, NVLink inside one node, the
    network beyond)."""
    sent = 2 * shape.params if nbytes is None else nbytes
    return sent / (gpu.link_bytes_per_s(cluster_gpus) * assumptions.link_efficiency)
