"""The simulation checked against what was measured.

- `calibrate_run(run_dir)`: a finished `dapo run` leaves `summary.json` and `metrics.jsonl` (one
  record per learner step). From the steady steps (the first `WARMUP_STEPS` left out) this reads
  the component rates: the learner's busy time per step (`timing_s/step`, weight sync included),
  the sync itself, a replica's generation time per group (`timing_s/gen_per_group`), the
  gatekeeper's pass rate and the response lengths; it simulates the run's config with them and
  compares what comes out with what the run measured: the step time (wall clock between steps),
  the learner's idle fraction (`timing_s/wait_data` over the step time) and the replicas' idle
  fraction (one minus the generation time of the jobs issued, over replicas x wall clock).
  A run on CPU (`summary.json` records the machine's cores and no GPUs) had its learner and
  replicas share the cores: they are simulated on `SharedCores`, and since the recorded rates are
  wall-clock rates under that sharing, the work each would take alone is solved first so that the
  simulated run records the same generation rate and learner step time as the real one
  (`solve_shared_work`).
- `published_cases()`: the asynchronous-vs-synchronous speed-ups other systems published
  (`published.toml`, each with its source), predicted from their configurations with the
  hardware model and one set of assumptions (`costs.Assumptions`), never tuned per case.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean
from typing import Any

from contracts.config import DapoConfig, load_config
from services.planning.capacity import ModelShape
from services.planning.costs import (
    DEFAULT_ASSUMPTIONS,
    Assumptions,
    DecodeModel,
    ResponseLengths,
    sync_seconds,
    train_seconds,
)
from services.planning.hardware import gpu_type
from services.planning.simulation import (
    ColocatedSpec,
    MeasuredGeneration,
    PipelineSpec,
    Prediction,
    simulate,
    simulate_colocated,
)

WARMUP_STEPS = 5
"""Left out of the measured steady state, as `services.run.progress.step_timing` does."""
HOP_SECONDS = 0.185e-3
"""One atomic Redis hop of a preset-sized group (bench/results/RESULTS.md, `stream_hops.py`)."""
PUBLISHED = Path(__file__).with_name("published.toml")
PROMPT_TOKENS_ASSUMED = 256
"""A DAPO-Math prompt with its template, where a publication does not say."""


@dataclass(frozen=True)
class RunMeasurement:
    """What one run measured in its steady state."""

    step_s: float
    learner_busy_s: float
    sync_s: float
    gen_s_per_group: float
    jobs_per_step: float
    pass_rate: float
    response_len_mean: float
    response_len_max: float
    learner_idle: float
    rollout_idle: float
    steps: int
    cpu_cores: int | None = None
    """The CPU cores the learner and the replicas shared (a run without GPUs), None on GPUs or
    where the run did not record its machine."""


def read_run(run_dir: str | Path) -> tuple[DapoConfig, RunMeasurement]:
    """The run's config and steady-state measurement from `config.yaml` and `metrics.jsonl`."""
    run = Path(run_dir)
    cfg = load_config(run / "config.yaml")
    records = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steady = [r for r in records if r["step"] > WARMUP_STEPS]
    if len(steady) < 10:
        raise ValueError(
            f"{run}: {len(steady)} steady steps in metrics.jsonl; calibration needs at least 10"
        )
    missing = [k for k in ("timing_s/gen_per_group", "timing_s/wait_data") if k not in steady[-1]]
    if missing:
        raise ValueError(
            f"{run}: metrics.jsonl lacks {missing} (recorded by the learner since `dapo plan` "
            "exists)"
        )
    span = float(steady[-1]["time"]) - float(steady[0]["time"])
    intervals = len(steady) - 1
    step_s = span / intervals
    jobs = (float(steady[-1]["ledger/issued"]) - float(steady[0]["ledger/issued"])) / intervals
    gen = fmean(float(r["timing_s/gen_per_group"]) for r in steady)
    wait = sum(float(r["timing_s/wait_data"]) for r in steady[1:])
    measured = RunMeasurement(
        step_s=step_s,
        learner_busy_s=fmean(float(r["timing_s/step"]) for r in steady),
        sync_s=fmean(float(r["timing_s/sync_weights"]) for r in steady),
        gen_s_per_group=gen,
        jobs_per_step=jobs,
        pass_rate=_pass_rate(steady),
        response_len_mean=fmean(float(r["response_length/mean"]) for r in steady),
        response_len_max=max(float(r["response_length/max"]) for r in steady),
        learner_idle=wait / span,
        rollout_idle=1.0 - jobs * gen / (cfg.rollout.replicas * step_s),
        steps=len(steady),
        cpu_cores=_shared_cpu_cores(run),
    )
    return cfg, measured


def _shared_cpu_cores(run: Path) -> int | None:
    """The cores a run's processes shared: `summary.json`'s `machine` record (written by `dapo
    run`), when the run had no GPUs."""
    summary = run / "summary.json"
    machine = json.loads(summary.read_text()).get("machine") if summary.exists() else None
    if (
        not isinstance(machine, dict)
        or int(machine.get("gpus", 0)) > 0
        or "cpu_cores" not in machine
    ):
        return None
    return int(machine["cpu_cores"])


def _pass_rate(steady: list[dict[str, Any]]) -> float:
    """The gatekeeper's pass rate over the steady steps: kept / (kept + filtered) of the groups
    gated between the first and the last steady record."""
    filtered = float(steady[-1]["gate/filtered_total"]) - float(steady[0]["gate/filtered_total"])
    issued = float(steady[-1]["ledger/issued"]) - float(steady[0]["ledger/issued"])
    in_flight = float(steady[-1]["ledger/in_flight"]) - float(steady[0]["ledger/in_flight"])
    gated = (
        issued - in_flight
    )  # what left the pipeline's entrance: filtered, trained or dropped stale
    return 1.0 - filtered / gated if gated > 0 else 1.0


def measured_spec(cfg: DapoConfig, m: RunMeasurement) -> PipelineSpec:
    """The pipeline of `cfg` with the component rates one run measured (as wall-clock rates; on
    shared CPU cores `solve_shared_work` turns them into each process's work alone)."""
    ro, alg, cores = cfg.rollout, cfg.algorithm, m.cpu_cores
    spec = PipelineSpec(
        replicas=ro.replicas,
        prompts_per_batch=ro.prompts_per_batch,
        group_size=ro.group_size,
        train_batch_groups=alg.train_batch_groups,
        oversampling=alg.oversampling,
        max_staleness=alg.max_staleness,
        pass_rate=m.pass_rate,
        generation=MeasuredGeneration(m.gen_s_per_group),
        learner_step_s=m.learner_busy_s - m.sync_s,
        sync_s=m.sync_s,
        lengths=ResponseLengths(m.response_len_mean, ro.max_response_len, 0.0),
        prompt_len=cfg.data.max_prompt_len,
        hop_s=HOP_SECONDS,
    )
    if cores is None:
        return spec
    # torch's default (torch_threads None) is a thread per core
    return replace(
        spec,
        cpu_cores=cores,
        learner_threads=cfg.learner.nproc * (cfg.learner.torch_threads or cores),
        replica_threads=ro.torch_threads or cores,
    )


SHARED_WORK_ITERATIONS = 5
"""Fixed-point iterations of `solve_shared_work` (it settles to 0.1% within three)."""


def solve_shared_work(
    spec: PipelineSpec, m: RunMeasurement, simulate_mean: Callable[[PipelineSpec], Prediction]
) -> PipelineSpec:
    """The generation and training work (each process alone on the cores) at which the simulated
    run records the measured wall-clock rates: a replica's `timing_s/gen_per_group` and the
    learner's `timing_s/step`. Under processor sharing the wall time of a piece of work is its
    work over the mean pace it ran at, so each is scaled by measured over simulated until they
    agree."""
    gen = m.gen_s_per_group
    for _ in range(SHARED_WORK_ITERATIONS):
        p = simulate_mean(spec)
        gen *= m.gen_s_per_group / p.gen_s_per_group
        learner = (
            spec.learner_step_s * (m.learner_busy_s - m.sync_s) / (p.learner_busy_s - spec.sync_s)
        )
        spec = replace(spec, generation=MeasuredGeneration(gen), learner_step_s=learner)
    return spec


@dataclass(frozen=True)
class RunCalibration:
    measured: RunMeasurement
    predicted: Prediction

    def errors(self) -> dict[str, float]:
        """Relative error of the step time; the idle fractions' errors both relative and in
        points of wall-clock time (an idle fraction of 0.15 predicted as 0.20 is 33% off
        relatively, 5 points absolutely)."""
        m, p = self.measured, self.predicted
        return {
            "step_time": p.step_s / m.step_s - 1,
            "learner_idle": p.learner_idle / m.learner_idle - 1,
            "learner_idle_points": p.learner_idle - m.learner_idle,
            "rollout_idle": p.rollout_idle / m.rollout_idle - 1,
            "rollout_idle_points": p.rollout_idle - m.rollout_idle,
        }


def calibrate_run(run_dir: str | Path, *, seeds: int = 5) -> RunCalibration:
    """Simulate a measured run with its own component rates (mean over `seeds` simulations)."""
    cfg, m = read_run(run_dir)

    def simulate_mean(spec: PipelineSpec) -> Prediction:
        runs = [
            simulate(spec, steps=m.steps + WARMUP_STEPS, warmup=WARMUP_STEPS, seed=s)
            for s in range(seeds)
        ]
        mean = {k: fmean(getattr(r, k) for r in runs) for k in runs[0].as_dict() if k != "steps"}
        return Prediction(**mean, steps=runs[0].steps)

    spec = measured_spec(cfg, m)
    if spec.cpu_cores is not None:
        spec = solve_shared_work(spec, m, simulate_mean)
    return RunCalibration(m, simulate_mean(spec))


# --- published systems ------------------------------------------------------------------------
@dataclass(frozen=True)
class PublishedCase:
    name: str
    source: str
    shape: ModelShape
    gpu: str
    gpus: int
    rollout_gpus: int
    tp: int
    prompts: int
    group_size: int
    max_response: int
    sync: str
    """`colocated` (every GPU generates, then every GPU trains) or `disaggregated` (the
    asynchronous system's own split with no staleness allowed)."""
    asynchronous: str
    """`one-step-off` (batch generation one step ahead) or `streaming` (slots refilled)."""
    sync_recomputes_logprobs: bool
    async_recomputes_logprobs: bool
    """A separate forward pass for the behaviour (or proximal) log-probs each step."""
    speedup: float
    staleness: float = 1.0
    sync_generation_s: float | None = None
    sync_training_s: float | None = None
    """The synchronous run's published phase times per step, where given
    (they calibrate the case)."""
    outside_the_model: str | None = None
    """Why the published speed-up is not one the pipeline model can explain, where it is not."""


def published_cases() -> list[PublishedCase]:
    raw = tomllib.loads(PUBLISHED.read_text())
    models = {name: ModelShape.from_config(fields) for name, fields in raw["models"].items()}
    return [
        PublishedCase(
            shape=models[case["model"]], **{k: v for k, v in case.items() if k != "model"}
        )
        for case in raw["cases"]
    ]


@dataclass(frozen=True)
class SpeedupPrediction:
    case: PublishedCase
    sync: Prediction
    asynchronous: Prediction

    @property
    def speedup(self) -> float:
        return self.sync.step_s / self.asynchronous.step_s

    @property
    def error(self) -> float:
        return self.speedup / self.case.speedup - 1


def predict_published(
    case: PublishedCase, assumptions: Assumptions = DEFAULT_ASSUMPTIONS, *, steps: int = 12
) -> SpeedupPrediction:
    """Synchronous and asynchronous step times of a published configuration from the hardware
    model, calibrated on the synchronous run's phase times where they are published (nothing
    measured in the asynchronous run goes in)."""
    model = _CaseModel(case, assumptions)
    if case.sync_training_s is not None:
        model.solve_mean_response(case.sync_training_s)
    sync = model.simulate_sync(steps)
    if case.sync_generation_s is not None:
        model.time_scale = case.sync_generation_s / model.sync_generation_s(steps)
        sync = model.simulate_sync(steps)
    return SpeedupPrediction(case, sync, model.simulate_async(steps))


class _CaseModel:
    """A published case on the hardware model, with what its synchronous run calibrates."""

    def __init__(self, case: PublishedCase, assumptions: Assumptions) -> None:
        self.case, self.assumptions, self.gpu = case, assumptions, gpu_type(case.gpu)
        self.lengths = ResponseLengths.assumed(case.max_response, assumptions)
        self.time_scale = 1.0
        self.sync_s = sync_seconds(case.shape, self.gpu, case.gpus, assumptions)

    def solve_mean_response(self, training_s: float) -> None:
        """The mean response length at which the synchronous run's training takes `training_s`
        (training time grows a little faster than the tokens: attention)."""
        for _ in range(4):
            scale = training_s / self.train(self.case.gpus, self.case.sync_recomputes_logprobs)
            self.lengths = self.lengths.with_mean(
                min(self.lengths.mean * scale, 0.9 * self.case.max_response)
            )

    def decode(self) -> DecodeModel:
        return DecodeModel(
            self.case.shape,
            self.gpu,
            self.case.tp,
            PROMPT_TOKENS_ASSUMED,
            self.lengths.mean,
            self.assumptions,
            time_scale=self.time_scale,
        )

    def train(self, gpus: int, recompute: bool) -> float:
        seq_len = PROMPT_TOKENS_ASSUMED + self.lengths.mean
        tokens = self.case.prompts * self.case.group_size * seq_len
        return train_seconds(
            self.case.shape,
            tokens,
            seq_len,
            gpus,
            self.gpu,
            self.assumptions,
            checkpointing=True,
            recompute_logprobs=recompute,
        )

    def colocated(self) -> ColocatedSpec:
        c = self.case
        return ColocatedSpec(
            replicas=c.gpus // c.tp,
            train_batch_groups=c.prompts,
            group_size=c.group_size,
            pass_rate=1.0,
            generation=self.decode(),
            learner_step_s=self.train(c.gpus, c.sync_recomputes_logprobs),
            switch_s=2 * self.sync_s,
            lengths=self.lengths,
        )

    def sync_generation_s(self, steps: int) -> float:
        spec = self.colocated()
        return simulate_colocated(spec, steps=steps).step_s - spec.learner_step_s - spec.switch_s

    def simulate_sync(self, steps: int) -> Prediction:
        c = self.case
        if c.sync == "colocated":
            return simulate_colocated(self.colocated(), steps=steps)
        return simulate(
            self.disaggregated(c.sync_recomputes_logprobs, staleness=0.0),
            steps=steps,
            warmup=2,
            decode=self.decode(),
        )

    def simulate_async(self, steps: int) -> Prediction:
        spec = self.disaggregated(
            self.case.async_recomputes_logprobs, staleness=self.case.staleness
        )
        return simulate(spec, steps=steps, warmup=2, decode=self.decode())

    def disaggregated(self, recompute: bool, *, staleness: float) -> PipelineSpec:
        c = self.case
        replicas = c.rollout_gpus // c.tp
        streaming = c.asynchronous == "streaming"
        return PipelineSpec(
            replicas=replicas,
            prompts_per_batch=math.ceil(c.prompts / replicas),
            group_size=c.group_size,
            train_batch_groups=c.prompts,
            oversampling=1.0,
            max_staleness=math.ceil(staleness),
            pass_rate=1.0,
            generation=self.decode(),
            learner_step_s=self.train(c.gpus - c.rollout_gpus, recompute),
            sync_s=self.sync_s,
            lengths=self.lengths,
            prompt_len=PROMPT_TOKENS_ASSUMED,
            streaming=streaming,
            admission_batches=1.0 + staleness,
            drop_stale=not streaming,
        )
