"""`dapo plan --config FILE --gpus N --gpu TYPE`: a config on a cluster that does not exist yet.

Prints the placement (`dapo run --dry-run`'s), the per-GPU memory budget (`capacity`), the
predicted step time, tokens/s, idle fractions and staleness of the config as written and of its
synchronous form, the rollout-to-learner GPU split and `max_staleness` the simulation finds
fastest, and what Redis will hold. Costs come from the hardware model (`costs`) with its one set
of assumptions; the pass rate is an input (`--pass-rate`), since it depends on the data and the
model, not on the cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from contracts.config import DapoConfig
from services.planning.capacity import ModelShape, budget, sync_bytes
from services.planning.costs import (
    DEFAULT_ASSUMPTIONS,
    Assumptions,
    DecodeModel,
    ResponseLengths,
    sync_seconds,
    train_seconds,
)
from services.planning.hardware import GpuType
from services.planning.placement import PlacementError, plan
from services.planning.simulation import PipelineSpec, Prediction, simulate

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
STALENESS_CHOICES = (0, 1, 2, 4)
WITHIN = 0.05
"""The recommended max_staleness is the smallest within this share of the fastest."""
SIM_STEPS, SIM_WARMUP = 14, 4


def model_shape(cfg: DapoConfig, model_config: str | None = None) -> ModelShape:
    """The model's architecture: `--model-config`, else `model.path/config.json`, else the
    preset's copy in configs/models/ (named after the model directory), else the tiny model's
    spec."""
    candidates = (
        [Path(model_config)]
        if model_config
        else [
            Path(cfg.model.path) / "config.json",
            MODELS / f"{Path(cfg.model.path).name.lower()}.json",
        ]
    )
    for path in candidates:
        if path.exists():
            return ModelShape.from_config(json.loads(path.read_text()))
    spec = cfg.model.build_tiny
    if spec is not None:
        return ModelShape(
            hidden=spec.hidden_size,
            layers=spec.num_layers,
            heads=spec.num_heads,
            kv_heads=spec.num_heads,
            intermediate=spec.intermediate_size,
            vocab=spec.vocab_size,
            tied=False,
        )
    raise FileNotFoundError(
        f"no model config among {[str(c) for c in candidates]}: pass --model-config FILE"
    )


@dataclass(frozen=True)
class Planner:
    cfg: DapoConfig
    shape: ModelShape
    gpu: GpuType
    gpus: int
    pass_rate: float
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS

    @property
    def lengths(self) -> ResponseLengths:
        return ResponseLengths.assumed(self.cfg.rollout.max_response_len, self.assumptions)

    def spec(
        self, learner_gpus: int, replicas: int, max_staleness: int
    ) -> tuple[PipelineSpec, DecodeModel]:
        cfg, a, lengths = self.cfg, self.assumptions, self.lengths
        prompt = cfg.data.max_prompt_len
        decode = DecodeModel(
            self.shape,
            self.gpu,
            cfg.rollout.tensor_parallel_size,
            prompt,
            lengths.mean,
            a,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        )
        seq = prompt + lengths.mean
        tokens = cfg.algorithm.train_batch_groups * cfg.rollout.group_size * seq
        learner_s = train_seconds(
            self.shape,
            tokens,
            seq,
            learner_gpus,
            self.gpu,
            a,
            checkpointing=cfg.learner.activation_checkpointing,
            frozen_base=cfg.learner.lora.enabled,
        )
        spec = PipelineSpec(
            replicas=replicas,
            prompts_per_batch=cfg.rollout.prompts_per_batch,
            group_size=cfg.rollout.group_size,
            train_batch_groups=cfg.algorithm.train_batch_groups,
            oversampling=cfg.algorithm.oversampling,
            max_staleness=max_staleness,
            pass_rate=self.pass_rate,
            generation=decode,
            learner_step_s=learner_s,
            sync_s=sync_seconds(
                self.shape, self.gpu, self.gpus, a, nbytes=sync_bytes(cfg, self.shape)
            ),
            lengths=lengths,
            prompt_len=prompt,
        )
        return spec, decode

    def predict(self, learner_gpus: int, replicas: int, max_staleness: int) -> Prediction:
        spec, decode = self.spec(learner_gpus, replicas, max_staleness)
        return simulate(spec, steps=SIM_STEPS, warmup=SIM_WARMUP, decode=decode)

    def splits(self) -> list[tuple[int, int]]:
        """(learner GPUs, replicas) that use the cluster, give every learner rank the same share
        of the batch's responses, and whose learner fits in memory."""
        tp, out = self.cfg.rollout.tensor_parallel_size, []
        responses = self.cfg.algorithm.train_batch_groups * self.cfg.rollout.group_size
        for learner in range(1, self.gpus):
            replicas = (self.gpus - learner) // tp
            if responses % learner:
                continue
            cfg = self.cfg.model_copy(
                update={"learner": self.cfg.learner.model_copy(update={"nproc": learner})}
            )
            if (
                replicas >= 1
                and budget(cfg, self.shape, self.gpu.memory_gib).learner_total
                <= self.gpu.memory_gib
            ):
                out.append((learner, replicas))
        return _spread(out)

    def recommend(self) -> tuple[tuple[int, int], int, Prediction] | None:
        """The fastest split at max_staleness 1, then the smallest max_staleness within WITHIN
        of the fastest staleness on that split."""
        splits = self.splits()
        if not splits:
            return None
        best = min(splits, key=lambda split: self.predict(split[0], split[1], 1).step_s)
        by_staleness = {k: self.predict(best[0], best[1], k) for k in STALENESS_CHOICES}
        fastest = min(p.step_s for p in by_staleness.values())
        k = next(k for k in STALENESS_CHOICES if by_staleness[k].step_s <= fastest * (1 + WITHIN))
        return best, k, by_staleness[k]


def _spread(splits: list[tuple[int, int]], most: int = 8) -> list[tuple[int, int]]:
    """At most `most` splits, evenly spaced (a 72-GPU cluster has 71 candidate splits)."""
    if len(splits) <= most:
        return splits
    step = (len(splits) - 1) / (most - 1)
    return [splits[round(i * step)] for i in range(most)]


def describe(p: Prediction) -> str:
    return (
        f"step {p.step_s:.1f} s, {p.tokens_per_s:,.0f} response tokens/s trained, learner idle "
        f"{p.learner_idle:.0%}, rollout idle {p.rollout_idle:.0%}, mean staleness "
        f"{p.mean_staleness:.2f}"
    )


def plan_text(
    cfg: DapoConfig, shape: ModelShape, gpu: GpuType, gpus: int, *, pass_rate: float
) -> str:
    """Everything `dapo plan` prints."""
    lines = [
        f"{cfg.run_name} on {gpus} x {gpu.name} ({gpu.memory_gib:.0f} GiB, {gpu.bf16_tflops:.0f} "
        f"bf16 TFLOPS, {gpu.hbm_tbs} TB/s); model {shape.params / 1e9:.2f}B parameters",
        "",
        "placement (as `dapo run --dry-run`):",
    ]
    planner = Planner(cfg, shape, gpu, gpus, pass_rate)
    try:
        lines.append(plan(cfg, gpus).describe())
        placed = True
    except PlacementError as exc:
        lines.append(f"  does not place: {exc}")
        placed = False
    lora = cfg.learner.lora
    trained = (
        f"LoRA adapters (rank {lora.rank}, {len(lora.target_modules)} modules a layer)"
        if lora.enabled
        else "every weight"
    )
    sync_s = sync_seconds(shape, gpu, gpus, planner.assumptions, nbytes=sync_bytes(cfg, shape))
    lines += [
        "",
        "memory per GPU:",
        budget(cfg, shape, gpu.memory_gib).describe(gpu.memory_gib),
        f"weight sync: {trained}, {_mib(sync_bytes(cfg, shape))} a replica a step "
        f"(about {sync_s:.2f} s)",
        "",
    ]
    a, lengths = planner.assumptions, planner.lengths
    lines.append(
        f"predicted (pass rate {pass_rate:.2f}; responses {lengths.mean:,.0f} tokens on average, "
        f"{a.truncated_fraction:.0%} reach {lengths.max_len:,}; docs/planning.md):"
    )
    if placed:
        nproc, replicas, k = cfg.learner.nproc, cfg.rollout.replicas, cfg.algorithm.max_staleness
        as_written = planner.predict(nproc, replicas, k)
        sync = planner.predict(nproc, replicas, 0)
        lines.append(f"  as configured (max_staleness {k}): {describe(as_written)}")
        lines.append(
            f"  synchronous (max_staleness 0): {describe(sync)}; asynchronous speed-up "
            f"{sync.step_s / as_written.step_s:.2f}x"
        )
        lines.append(
            f"  Redis: peak {_mib(as_written.redis_peak_bytes)} of stream entries and metrics, "
            f"{_mib(as_written.redis_bytes_per_s)}/s of stream traffic"
        )
    best = planner.recommend()
    if best is None:
        lines.append(f"  recommended: no split of {gpus} GPUs gives the learner enough memory")
    else:
        (learner, reps), k, pred = best
        lines.append(
            f"  recommended: learner.nproc={learner} rollout.replicas={reps} "
            f"algorithm.max_staleness={k}: {describe(pred)}"
        )
        lines.append(
            f"  Redis at the recommendation: peak {_mib(pred.redis_peak_bytes)}, "
            f"{_mib(pred.redis_bytes_per_s)}/s"
        )
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"
