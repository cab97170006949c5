"""The whole DAPO algorithm on one page: one process, one synchronous loop, no Redis.

Read this first. `dapo run --in-process` runs it; `bench/inprocess_floor.py` measures the service
system against it. It calls the very functions the services call, in the order a prompt meets
them; `dapo run` runs the same calls in separate processes joined by Redis streams:

    this loop calls                         `dapo run` runs it in
    contracts.data.encode_prompt            learner/feeder.py (learner rank 0): a prompt job
    engine.generate (rollout.hf_engine)     rollout/service.py: a replica, G responses with
                                            their behaviour log-probs (with `rollout.tools`:
                                            rollout.tool_use.generate_with_tools, the calls in
                                            sandboxes)
    reward.service.score_group              reward/service.py: a reward worker (±1 verifier,
                                            overlong shaping)
    gatekeeper.service.keep_group           gatekeeper/service.py: dynamic sampling
    learner.batch.build_batch               learner/loop.py (rank 0): padded tensors and
                                            group-relative advantages
    trainer.train_step (learner.trainer)    learner/trainer.py on every rank: the DAPO loss
                                            (learner/algos/), FSDP2, AdamW
    engine.update_weights                   learner/weight_publisher.py -> rollout/
                                            weight_receiver.py: a broadcast to the replicas
    services.experiments.evaluation         learner/evaluation.py issues eval jobs; replicas,
      .evaluate                             reward workers and the gatekeeper answer them

What the service system adds, and this loop does not have: asynchrony (replicas generate while
the learner trains, bounded by `algorithm.max_staleness`; here every row is on-policy), several
replicas and learner ranks, the ledger, checkpoints and resume, the control plane, fault
handling. Generation uses the transformers engine whatever `rollout.engine` says.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from contracts import eval_stats
from contracts.config import DapoConfig
from contracts.data import PromptRecord, encode_prompt, load_prompts
from contracts.eval_stats import EVAL_ROUNDS_FILE, Round
from contracts.schemas import PromptJob, Response, RolloutGroup, ScoredGroup
from gatekeeper.service import group_metric, keep_group
from learner.batch import build_batch
from learner.export import HFExporter
from learner.service import init_distributed
from learner.trainer import Trainer
from reward.service import open_scorer, score_group
from rollout.hf_engine import HFEngine
from rollout.sample import Sample
from rollout.tool_use import ToolBox, generate_with_tools
from services.data.prepare import prepare
from services.experiments.evaluation import eval_prompts, evaluate

log = logging.getLogger(__name__)


@dataclass
class InProcessResult:
    steps: int
    eval_history: list[list[float]] = field(default_factory=list)
    """[step, avg@k accuracy, RL seconds so far], one per evaluation."""
    rounds: list[Round] = field(default_factory=list)
    """The same evaluations problem by problem (`contracts.eval_stats`)."""
    rl_seconds: float = 0.0
    """Generation, scoring and training time; evaluations stop the clock."""
    groups_generated: int = 0
    groups_trained: int = 0
    train_seconds: float = 0.0
    train_tokens: float = 0.0

    @property
    def train_tokens_per_s(self) -> float:
        return self.train_tokens / self.train_seconds if self.train_seconds else 0.0

    def seconds_to_gain(self, gain: float) -> float:
        return seconds_to_gain(self.eval_history, gain)


def seconds_to_gain(history: list[list[float]], gain: float) -> float:
    """RL seconds of the first evaluation at least `gain` above the first one, from a history of
    [step, accuracy, RL seconds] (nan if none; also reads a service run's eval history). Benches
    that compare runs use one base figure for every arm instead (`contracts.eval_stats`)."""
    if not history:
        return math.nan
    return eval_stats.seconds_to_gain([(rl, acc) for _, acc, rl in history], history[0][1], gain)


def run_in_process(
    cfg: DapoConfig,
    *,
    on_eval: Callable[[int, float, float], None] | None = None,
    export_to: Path | None = None,
) -> InProcessResult:
    """Train `cfg.learner.total_steps` DAPO steps in this process; evaluate avg@k before the
    first step, every `eval.every_steps` steps and after the last (`on_eval(step, acc, rl_s)`
    after each); export the final weights as a Hugging Face model to `export_to` if given."""
    run = InProcessRun(cfg, on_eval)
    result, every = run.result, cfg.eval.every_steps
    try:
        run.evaluate(step=0)
        for step in range(1, result.steps + 1):
            start = time.monotonic()
            kept = run.dynamic_sampling()
            run.train(kept)
            result.rl_seconds += time.monotonic() - start
            if (every and step % every == 0) or step == result.steps:
                run.evaluate(step)
        if export_to is not None:
            run.export(export_to)
    finally:
        run.close()
    return result


class InProcessRun:
    """The parts of one in-process run (the services' parts, in one process) and the loop's
    steps on them: generate and score a batch, sample dynamically, train, evaluate."""

    def __init__(
        self, cfg: DapoConfig, on_eval: Callable[[int, float, float], None] | None = None
    ) -> None:
        prepare(cfg)  # the data files and the base model, as `dapo run` prepares them
        init_distributed(cfg)  # a one-rank process group: the trainer's FSDP2 code path
        self.cfg, self.on_eval = cfg, on_eval
        self.trainer = Trainer(cfg, rank=0, world_size=1, backend="gloo")
        self.lora = cfg.learner.lora if cfg.learner.lora.enabled else None
        self.engine = HFEngine(
            cfg.model.path, dtype=cfg.model.dtype, seed=cfg.rollout.seed, lora=self.lora
        )
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.scorer = open_scorer(cfg.reward, gym=cfg.data.gym is not None)
        tools = cfg.rollout.tools
        self.tools = ToolBox(tools, self.tokenizer) if tools.enabled else None
        self.records = load_prompts(cfg.data.train_path, columns=cfg.data.columns)
        self.order = list(range(len(self.records)))
        random.Random(cfg.data.seed).shuffle(self.order)
        self.cursor = 0
        self.eval_records, self.eval_ids = eval_prompts(cfg, self.tokenizer)
        self.result = InProcessResult(steps=cfg.learner.total_steps)

    def dynamic_sampling(self) -> list[ScoredGroup]:
        """Generate until `train_batch_groups` groups pass the gate (all-correct and all-wrong
        groups dropped); the batch's groups, in the order they passed."""
        alg, kept = self.cfg.algorithm, list[ScoredGroup]()
        while len(kept) < alg.train_batch_groups:
            kept += [
                g
                for g in self.generate_and_score()
                if not alg.gatekeeper or keep_group(group_metric(g, alg.gatekeeper_metric))
            ]
        return kept[: alg.train_batch_groups]

    def generate_and_score(self) -> list[ScoredGroup]:
        """One generation batch of `rollout.prompts_per_batch` prompts (a replica's batch),
        judged as the reward workers judge it."""
        ro, cfg = self.cfg.rollout, self.cfg
        picks = [
            self.order[(self.cursor + i) % len(self.records)] for i in range(ro.prompts_per_batch)
        ]
        self.cursor += ro.prompts_per_batch
        batch = [self.records[i] for i in picks]
        prompts = [
            encode_prompt(self.tokenizer, r.messages, cfg.data.max_prompt_len, chat=cfg.data.chat)
            for r in batch
        ]
        generate = (
            self.engine.generate
            if self.tools is None
            else functools.partial(generate_with_tools, self.engine, self.tools)  # rollout.tools
        )
        outs = generate(
            prompts,
            n=ro.group_size,
            max_tokens=ro.max_response_len,
            temperature=ro.temperature,
            top_p=ro.top_p,
            stop=ro.stop,
        )
        groups = []
        for record, ids, samples in zip(batch, prompts, outs, strict=True):
            group = _as_group(record, ids, samples, f"inproc-{self.result.groups_generated}")
            self.result.groups_generated += 1
            groups.append(score_group(group, self.tokenizer, self.scorer, cfg)[0])
        return groups

    def train(self, kept: list[ScoredGroup]) -> None:
        """One optimizer step on the batch, then the engine takes the new weights (a memory
        copy, not a broadcast): every row is on-policy, so no behaviour correction."""
        alg, result = self.cfg.algorithm, self.result
        batch = build_batch(
            kept,
            pad_id=0,
            norm_by_std=alg.norm_by_std,
            overlong_filter=self.cfg.reward.overlong.filter,
        )
        trained_at = time.monotonic()
        self.trainer.train_step(batch, policy_version=0)
        result.train_seconds += time.monotonic() - trained_at
        result.train_tokens += float(batch.response_mask.sum())
        result.groups_trained += len(kept)
        self.engine.update_weights(self.trainer.named_full_params())

    def evaluate(self, step: int) -> None:
        """A round of the weights of `step`, paired with the services' (the same seeds)."""
        if not self.eval_records or not self.cfg.eval.in_run:
            return
        metrics, per_problem = evaluate(
            self.engine,
            self.tokenizer,
            self.eval_records,
            self.eval_ids,
            self.cfg,
            tools=self.tools,
        )
        result, acc = self.result, metrics["eval/acc"]
        result.eval_history.append([step, acc, round(result.rl_seconds, 2)])
        result.rounds.append(
            Round(
                step=step,
                rl_seconds=round(result.rl_seconds, 2),
                per_problem=tuple(per_problem),
                policy_version=step,
                extra={"acc_ci": [metrics["eval/acc_ci_low"], metrics["eval/acc_ci_high"]]},
            )
        )
        if self.on_eval is not None:
            self.on_eval(step, acc, result.rl_seconds)

    def export(self, to: Path) -> None:
        HFExporter(self.cfg.model.path, lora=self.lora).export(self.trainer.named_full_params(), to)

    def close(self) -> None:
        self.scorer.close()
        if self.tools is not None:
            self.tools.close()


def _as_group(
    record: PromptRecord, ids: list[int], samples: list[Sample], group_id: str
) -> RolloutGroup:
    """A prompt's samples as the message a replica sends (version 0: one policy throughout)."""
    job = PromptJob(
        group_id=group_id,
        prompt_index=record.index,
        prompt_ids=ids,
        ground_truth=record.ground_truth,
        data_source=record.data_source,
        issued_version=0,
        issued_at=0.0,
        extra_info=record.extra_info,
    )
    responses = [
        Response(
            token_ids=s.token_ids,
            logprobs=s.logprobs,
            finish_reason=s.response_finish,
            tool_spans=s.tool_spans,
            tool_calls=s.tool_calls,
            tool_errors=s.tool_errors,
            tool_timeouts=s.tool_timeouts,
            tool_seconds=s.tool_seconds,
        )
        for s in samples
    ]
    return RolloutGroup(job=job, policy_version=0, replica_id="in-process", responses=responses)


def main(cfg: DapoConfig) -> int:
    """`dapo run --in-process`: train, print each evaluation, write `<output_dir>/summary.json`
    and the final weights to `<output_dir>/hf`."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    def report(step: int, acc: float, rl_s: float) -> None:
        log.info(
            "step %d: eval avg@%d %.3f at %.1f RL seconds",
            step,
            cfg.eval.samples_per_problem,
            acc,
            rl_s,
        )

    result = run_in_process(cfg, on_eval=report, export_to=out / "hf")
    (out / EVAL_ROUNDS_FILE).write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in result.rounds)
    )
    summary = {
        **{k: v for k, v in asdict(result).items() if k != "rounds"},
        "train_tokens_per_s": result.train_tokens_per_s,
        "mode": "in-process",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    first, last = (
        (result.eval_history[0][1], result.eval_history[-1][1]) if result.eval_history else (0, 0)
    )
    log.info(
        "%d steps in %.0f RL seconds; eval %.3f -> %.3f; %d groups generated for %d trained; "
        "summary in %s, weights in %s",
        result.steps,
        result.rl_seconds,
        first,
        last,
        result.groups_generated,
        result.groups_trained,
        out / "summary.json",
        out / "hf",
    )
    return 0
