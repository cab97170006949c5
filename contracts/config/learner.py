"""`learner`, `checkpoint` and `eval`: the training process, the checkpoints it keeps and the
evaluation rounds it runs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from contracts.config.base import PositiveInt, Section

LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear map of a Llama/Qwen2-style decoder layer: attention and MLP."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021) instead of full fine-tuning (`peft`).

    On: the base weights are frozen (bf16 on GPU, the dtype they are served in) and only the
    adapters train, so the optimizer state and the gradients are the adapters' alone; the
    weight sync sends only the adapters (the replicas keep the base they loaded); checkpoints
    keep the adapters with their optimizer state, and exports are `peft` adapter folders
    (`dapo lora merge` writes the merged model). The DAPO loss is unchanged.
    """

    enabled: bool = False
    rank: PositiveInt = 16
    """r: the adapters' inner dimension. Every replica's vLLM engine is sized for it."""
    alpha: PositiveInt = 32
    """The update is scaled by alpha / rank (peft's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in the training pass only. pi_old always comes from a pass
    without it, as the replicas sample (so it stays equal to their behaviour log-probs); above 0
    that costs one more forward pass per step (`learner/trainer.py`)."""
    target_modules: tuple[str, ...] = LORA_TARGETS_DEFAULT
    """Names of the decoder layers' linear modules that get adapters. The output head and the
    embeddings never do (the learner's fused log-prob head reads the head's weight)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        banned = {"lm_head", "embed_tokens"} & set(value)
        if not value or banned:
            raise ValueError(
                "learner.lora.target_modules must name decoder-layer linear modules "
                f"(e.g. q_proj, v_proj); got {list(value)}"
            )
        return value


class LearnerConfig(Section):
    total_steps: PositiveInt = 300
    """Training steps (policy versions) in the run."""
    sample_budget: PositiveInt | None = None
    """End the run, before `total_steps` if need be, once this many responses were requested for
    training (issued prompt jobs x `rollout.group_size`; evaluation not counted). Groups the
    gatekeeper filters count: runs with and without dynamic sampling then compare at equal
    generation cost (`dapo ablate`). Exact: the feeder issues ceil(budget / group_size) jobs and
    no more (the last admission is trimmed), so a multiple of `group_size` is spent to the
    response. None = `total_steps` alone."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (paper: 1e-6 for 32B)."""
    weight_decay: float = Field(0.1, ge=0)
    """Paper: 0.1."""
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip (paper: 1.0)."""
    max_nonfinite_steps: PositiveInt = 3
    """A mini-batch update whose loss or global gradient norm is NaN or infinite is skipped
    (gradients zeroed, no optimizer step, no warm-up step), so the weights are never poisoned;
    the learner exits with an error after this many training steps in a row skipped an update
    (`dapo run` then restarts it from the newest checkpoint, within its restart limit). Not in
    the paper: a guard; a run that keeps diverging needs a lower `lr` or a look at its data."""
    warmup_steps: Annotated[int, Field(ge=0)] = 20
    """Linear warm-up over rollout steps (paper: 20), then constant."""
    micro_batch_size: PositiveInt = 8
    """Responses per forward/backward; changes memory, never the loss value."""
    nproc: PositiveInt = 1
    """Data-parallel learner ranks `dapo run` launches with torchrun."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto = nccl when CUDA is available, else gloo."""
    collective_timeout_s: float = Field(120.0, gt=0, le=24 * 3600)
    """Timeout on every collective (training and weight broadcast)."""
    lease_ttl_s: float = Field(30.0, gt=0)
    """The learner lease (one learner per run, `contracts/lease.py`): renewed every third
    of this; a learner that stops renewing (killed, paused) loses the lease this long after."""
    lease_wait_s: float = Field(60.0, ge=0)
    """How long a starting learner waits for another learner's lease before exiting with an
    error naming the holder (a restarted pod waits out its predecessor's TTL)."""
    weights_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the weight-broadcast group (learner rank 0 + replicas). auto = the training
    backend. Use gloo when the learner and a replica share one GPU: NCCL refuses two ranks on
    one device."""
    broadcast_bucket_mb: PositiveInt = 256
    """Weights are broadcast to rollout replicas in buckets of about this size."""
    torch_threads: PositiveInt | None = None
    """CPU threads per learner rank (None = torch's default)."""
    mixed_precision: Literal["auto", "native", "bf16", "none"] = "auto"
    """The learner's compute dtype (FSDP2 mixed precision). `bf16`: forward and backward run on
    bf16 copies of the weights, gradients are reduced in fp32; the master weights, their
    gradients and AdamW's state stay fp32 and sharded, and so do checkpoints and the weights
    published to the replicas; log-probs, entropy and the loss are computed in fp32 from bf16
    logits. `none`: fp32 throughout. `native`: bf16 where the device computes it natively (a
    CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX-BF16, or Arm's BF16 extension),
    fp32 elsewhere, decided and logged at start. `auto`: bf16 on CUDA GPUs that support it, fp32
    on every CPU: every preset runs this (the GPU presets in bf16, the CPU ones in fp32), which
    keeps CPU runs in the dtype their results were measured in. On the project's 2-core EPYC
    (avx512_bf16) a SmolLM2-135M step at its preset's shape took 3.4 s in bf16 against 8.5 s in
    fp32 (bench/learner_flops.py, bench/results/2026-12-06-learner-speed.md), with log-probs a
    mean 0.05 nats (at most 0.31) from fp32's on the same tokens: an fp32 replica then samples
    from a slightly different policy than the one trained, a gap the importance weight of
    docs/algorithm.md s9 corrects on off-policy rows only (on-policy rows take mu = pi_old)."""
    retain_freed_memory: bool = True
    """A CPU learner keeps the memory it frees for its next allocations (glibc `mallopt`,
    `learner/cpu_memory.py`) instead of returning every block over 32 MiB to the system: a step
    allocates and frees the same large tensors every micro-batch, and each fresh block is paid
    again in page faults. SmolLM2-135M in bf16 on one thread of the 2-core VM: 2.1 s a step with
    glibc's defaults, 1.6 s with this; the learner's peak RSS 6-10% higher, and held. GPU learners
    and non-glibc systems: no effect."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    less memory for long responses, about one more forward pass of compute."""
    share_prompts: Literal["auto", "always", "never"] = "auto"
    """Run each group's prompt once per forward pass, its responses packed behind it
    (`learner/batch.py` `pack_groups`), instead of once per response. auto = when it costs fewer
    FLOPs (short responses after long prompts: the CPU preset); never for long responses, whose
    packed attention would cost more than the prompt tokens saved."""
    lora: LoraConfig = LoraConfig()
    """Train low-rank adapters instead of every weight (off by default)."""
    seed: int = 0


class CheckpointConfig(Section):
    dir: str | None = None
    """Checkpoint store. None = `<output_dir>/checkpoints`."""
    every_steps: Annotated[int, Field(ge=0)] = 50
    """0 disables periodic checkpoints (saves on request and at the end still happen)."""
    keep_last: PositiveInt = 3
    save_hf: bool = True
    """Also export a Hugging Face folder (safetensors + config + tokenizer) in `hf/`."""


class EvalConfig(Section):
    every_steps: Annotated[int, Field(ge=0)] = 10
    """Evaluate every N steps (0 = only at start and end)."""
    in_run: bool = True
    """False: no round during the run, not even the base or the final one. For runs whose
    rounds would cost more than their training (a real model on one CPU replica): their
    checkpoints are evaluated afterwards with the same seeds (`dapo eval --model-dir
    <checkpoint>/hf`, as bench/real_model.py does), and the run's summary has no accuracy."""
    samples_per_problem: PositiveInt = 32
    """k of avg@k (paper: avg@32 on AIME 2024)."""
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(0.7, gt=0, le=1)
    """Paper: top_p 0.7 for evaluation."""
    max_problems: PositiveInt | None = None
    """Evaluate on the first N distinct problems only (None = all)."""
    seed: int = 0
    """Sample j of problem i is drawn with a seed of (this, i, j) alone (`rollout.engine.
    eval_seeds`), by the replicas, `dapo run --in-process` and `dapo eval` alike: the same
    weights give the same round in any run, replica count or restart, so two runs' rounds differ
    by their weights only (paired evaluation)."""
    final_wait_s: float = Field(3600.0, gt=0)
    """How long the end of a run waits for its final evaluation round (generated by the
    replicas) before it records the run without it."""
